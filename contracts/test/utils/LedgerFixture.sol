// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Test} from "forge-std/Test.sol";
import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";

import {NodeRegistry} from "../../src/NodeRegistry.sol";
import {TrainingLedger} from "../../src/TrainingLedger.sol";
import {ITrainingLedger} from "../../src/interfaces/ITrainingLedger.sol";

/// @notice A registry bound to a ledger, four staked nodes, three arbiters, and helpers
/// that build correctly signed steps; shared by the ledger test suites.
abstract contract LedgerFixture is Test {
    bytes32 internal constant DOMAIN_TYPEHASH =
        keccak256("EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)");
    bytes32 internal constant CONTRIBUTION_TYPEHASH = keccak256(
        "Contribution(uint256 runId,uint64 step,uint32 replica,uint32 stage,uint256 replicaSet,bytes32 parent,bytes32 contribution,bytes32 dataShard,bytes32 codeHash,int64 lossMicros,bytes32 newShard)"
    );
    bytes32 internal constant CONFIG = keccak256("config");
    bytes32 internal constant GENESIS = keccak256("genesis");
    bytes32 internal constant CODE = keccak256("trainer source");
    uint256 internal constant MIN_STAKE = 1 ether;
    uint64 internal constant WINDOW = 100;
    uint64 internal constant UNBONDING_DELAY = 7 days;
    uint256 internal constant REPORTER_BPS = 5_000;

    /// @dev The arguments of one commitStep call.
    struct StepCall {
        uint256 runId;
        uint64 step;
        bytes32 parent;
        bytes32 checkpoint;
        bytes32 contributionsRoot;
        bytes32 metricsDigest;
        uint256 replicaSet;
        ITrainingLedger.Attestation[] attestations;
    }

    NodeRegistry internal registry;
    TrainingLedger internal ledger;
    address[] internal nodes;
    uint256[] internal keys;
    address[] internal arbiters;
    uint256[] internal arbiterKeys;
    address internal submitter = makeAddr("submitter");
    address internal treasury = makeAddr("treasury");
    address internal verifier;
    /// @dev Mixed into checkpoints, so a step re-committed after a rollback differs.
    uint256 internal salt;

    function setUp() public virtual {
        registry = new NodeRegistry(treasury, REPORTER_BPS, UNBONDING_DELAY);
        ledger = new TrainingLedger(registry);
        registry.bindLedger(address(ledger));
        for (uint256 i = 0; i < 4; ++i) {
            _addStakedNode(string.concat("node", vm.toString(i)), MIN_STAKE);
        }
        for (uint256 i = 0; i < 3; ++i) {
            (address arbiter, uint256 key) = makeAddrAndKey(string.concat("arbiter", vm.toString(i)));
            arbiters.push(arbiter);
            arbiterKeys.push(key);
        }
        // A staked node outside every run: the challenger of the challenge tests.
        verifier = _registerAndStake("verifier", MIN_STAKE);
        vm.deal(verifier, 100 ether);
    }

    // ---------------------------------------------------------------- helpers

    /// @dev The operator of the node key named `name`.
    function _operatorOf(string memory name) internal returns (address) {
        return makeAddr(string.concat(name, "-operator"));
    }

    /// @dev Registers the key `name` for its operator, who stakes `amount` behind it.
    function _registerAndStake(string memory name, uint256 amount) internal returns (address node) {
        node = makeAddr(name);
        address operator = _operatorOf(name);
        vm.prank(node);
        registry.register(operator);
        if (amount > 0) {
            vm.deal(operator, operator.balance + amount);
            vm.prank(operator);
            registry.stake{value: amount}(node);
        }
    }

    function _addStakedNode(string memory name, uint256 amount) internal returns (address node, uint256 key) {
        (, key) = makeAddrAndKey(name);
        node = _registerAndStake(name, amount);
        nodes.push(node);
        keys.push(key);
    }

    /// @dev The node keys that signed each slot of `c`, in slot order.
    function _signersOf(StepCall memory c) internal view returns (address[] memory signers) {
        signers = new address[](c.attestations.length);
        for (uint256 i = 0; i < signers.length; ++i) {
            signers[i] = _recover(c, i);
        }
    }

    /// @dev `count` arbiter signatures on `Verdict(challengeId, upheld)`, sorted by signer.
    function _verdicts(uint256 challengeId, bool upheld, uint256 count) internal view returns (bytes[] memory sigs) {
        bytes32 digest = ledger.verdictDigest(challengeId, upheld);
        uint256[] memory order = _arbitersAscending();
        sigs = new bytes[](count);
        for (uint256 i = 0; i < count; ++i) {
            sigs[i] = _sign(arbiterKeys[order[i]], digest);
        }
    }

    /// @dev Indices of `arbiters`, sorted by ascending address.
    function _arbitersAscending() internal view returns (uint256[] memory order) {
        order = new uint256[](arbiters.length);
        for (uint256 i = 0; i < order.length; ++i) {
            order[i] = i;
        }
        for (uint256 i = 1; i < order.length; ++i) {
            for (uint256 j = i; j > 0 && arbiters[order[j - 1]] > arbiters[order[j]]; --j) {
                (order[j - 1], order[j]) = (order[j], order[j - 1]);
            }
        }
    }

    /// @dev Commits the next step of `runId` and returns its call.
    function _commitNext(uint256 runId) internal returns (StepCall memory c) {
        c = _nextStep(runId);
        _commit(c);
    }

    /// @dev Opens a challenge by `verifier` against slot (`replica`, `stage`) of step `c`.
    function _challenge(StepCall memory c, uint32 replica, uint32 stage) internal returns (uint256) {
        address[] memory signers = _signersOf(c);
        vm.prank(verifier);
        return ledger.openChallenge{value: MIN_STAKE}(
            c.runId, c.step, replica, stage, c.replicaSet, signers, _shardsRoot(c), keccak256("evidence")
        );
    }

    /// @dev The stage shard digests step `c` co-signs, in stage order (its first replica's).
    function _shardsOf(StepCall memory c) internal view returns (bytes32[] memory shards) {
        (, uint32 stages) = _shapeOf(c.runId);
        shards = new bytes32[](stages);
        for (uint256 s = 0; s < stages; ++s) {
            shards[s] = c.attestations[s].newShard;
        }
    }

    function _shardsRoot(StepCall memory c) internal view returns (bytes32) {
        return keccak256(abi.encodePacked(_shardsOf(c)));
    }

    /// @dev The shards root `_nextStep` gives step `step` of `runId` (at the current salt).
    function _shardsRootAt(uint256 runId, uint64 step) internal view returns (bytes32) {
        (, uint32 stages) = _shapeOf(runId);
        bytes32[] memory shards = new bytes32[](stages);
        for (uint32 s = 0; s < stages; ++s) {
            shards[s] = _newShard(runId, step, s);
        }
        return keccak256(abi.encodePacked(shards));
    }

    function _newShard(uint256 runId, uint64 step, uint32 stage) internal view returns (bytes32) {
        return keccak256(abi.encode("new shard", runId, step, stage, salt));
    }

    /// @dev Opens an aggregate challenge by `verifier` against stage `stage` of step `c`.
    function _challengeAggregate(StepCall memory c, uint32 stage) internal returns (uint256) {
        address[] memory signers = _signersOf(c);
        bytes32[] memory shards = _shardsOf(c);
        vm.prank(verifier);
        return
            ledger.openAggregateChallenge{value: MIN_STAKE}(
                c.runId, c.step, stage, c.replicaSet, signers, shards, keccak256("evidence")
            );
    }

    /// @dev A closed run without rewards, from createRun's fields in order.
    function _runSpec(
        bytes32 configDigest,
        bytes32 genesisDigest,
        address[] memory members,
        uint32 replicas,
        uint32 stages,
        uint32 minReplicas,
        uint64 challengeWindow,
        uint256 minStake,
        address[] memory arbiters_,
        uint32 quorum,
        uint8 independence
    ) internal pure returns (ITrainingLedger.RunSpec memory) {
        return ITrainingLedger.RunSpec({
            configDigest: configDigest,
            genesisDigest: genesisDigest,
            nodes: members,
            replicas: replicas,
            stages: stages,
            minReplicas: minReplicas,
            challengeWindow: challengeWindow,
            minStake: minStake,
            arbiters: arbiters_,
            quorum: quorum,
            independence: independence,
            admission: 0,
            rewardPerStep: 0
        });
    }

    /// @dev A 2 x 2 run over the four setUp nodes, every step with both replicas.
    function _createRun() internal returns (uint256) {
        return ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, WINDOW, MIN_STAKE, arbiters, 2, 0));
    }

    function _createRun(uint32 replicas, uint32 stages, uint256 minStake) internal returns (uint256) {
        return ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, replicas, stages, replicas, WINDOW, minStake, arbiters, 2, 0));
    }

    /// @dev A `replicas` x `stages` run whose steps need `minReplicas` of the replicas.
    function _createElasticRun(uint32 replicas, uint32 stages, uint32 minReplicas) internal returns (uint256 runId) {
        runId = ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, replicas, stages, minReplicas, WINDOW, MIN_STAKE, arbiters, 2, 0));
        _shapes[runId] = [replicas, stages];
    }

    /// @dev A 2 x 2 run over the four setUp nodes whose replicas must have distinct operators.
    function _createOperatorRun() internal returns (uint256) {
        return ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, WINDOW, MIN_STAKE, arbiters, 2, 1));
    }

    function _sign(uint256 key, bytes32 digest) internal pure returns (bytes memory) {
        (uint8 v, bytes32 r, bytes32 s) = vm.sign(key, digest);
        return abi.encodePacked(r, s, v);
    }

    function _digest(uint256 runId, uint64 step, bytes32 parent, ITrainingLedger.Attestation memory a)
        internal
        view
        returns (bytes32)
    {
        return ledger.contributionDigest(runId, step, parent, a);
    }

    /// @dev The attestation for slot (replica, stage) of a full step, signed by `key` through
    /// `ledger`.
    function _attestation(uint256 key, uint256 runId, uint64 step, bytes32 parent, uint32 replica, uint32 stage)
        internal
        view
        returns (ITrainingLedger.Attestation memory a)
    {
        (uint32 replicas,) = _shapeOf(runId);
        return _attestation(key, runId, step, parent, replica, stage, _fullSet(replicas));
    }

    /// @dev The attestation for slot (replica, stage) of a step over `replicaSet`, signed by
    /// `key` through `ledger`.
    function _attestation(
        uint256 key,
        uint256 runId,
        uint64 step,
        bytes32 parent,
        uint32 replica,
        uint32 stage,
        uint256 replicaSet
    ) internal view returns (ITrainingLedger.Attestation memory a) {
        a.replica = replica;
        a.stage = stage;
        a.replicaSet = replicaSet;
        a.contribution = keccak256(abi.encode("contribution", runId, step, replica, stage));
        a.dataShard = keccak256(abi.encode("shard", step, replica));
        a.codeHash = CODE;
        // Losses are signed: odd replicas report a negative value.
        a.lossMicros = replica % 2 == 0 ? int64(2_345_678) : int64(-1_234);
        // Every replica of a stage computes the same new shard.
        a.newShard = _newShard(runId, step, stage);
        (a.r, a.vs) = vm.signCompact(key, _digest(runId, step, parent, a));
    }

    function _root(ITrainingLedger.Attestation[] memory attestations) internal pure returns (bytes32) {
        bytes memory packed;
        for (uint256 i = 0; i < attestations.length; ++i) {
            packed = bytes.concat(packed, attestations[i].contribution);
        }
        return keccak256(packed);
    }

    /// @dev A valid commit of the step after the head of `runId` with every replica; slot i
    /// is signed by key i (modulo the number of nodes).
    function _nextStep(uint256 runId) internal view returns (StepCall memory c) {
        (uint32 replicas,) = _shapeOf(runId);
        return _nextStep(runId, _fullSet(replicas));
    }

    /// @dev A valid commit of the step after the head of `runId` over the replicas of
    /// `replicaSet`: replica r's stage s is signed by key r * stages + s (modulo the number
    /// of nodes), the key it has in a full step.
    function _nextStep(uint256 runId, uint256 replicaSet) internal view returns (StepCall memory c) {
        c.runId = runId;
        (c.parent, c.step) = ledger.runHead(runId);
        c.step += 1;
        c.checkpoint = keccak256(abi.encode("checkpoint", runId, c.step, salt));
        c.metricsDigest = keccak256(abi.encode("metrics", runId, c.step));
        c.replicaSet = replicaSet;
        (uint32 replicas, uint32 stages) = _shapeOf(runId);
        c.attestations = new ITrainingLedger.Attestation[](_popcount(replicaSet) * stages);
        uint256 slot = 0;
        for (uint32 r = 0; r < replicas; ++r) {
            if ((replicaSet >> r) & 1 == 0) continue;
            for (uint32 s = 0; s < stages; ++s) {
                c.attestations[slot++] =
                    _attestation(keys[(uint256(r) * stages + s) % keys.length], runId, c.step, c.parent, r, s, replicaSet);
            }
        }
        c.contributionsRoot = _root(c.attestations);
    }

    /// @dev The replica set of every replica of a `replicas`-replica run.
    function _fullSet(uint32 replicas) internal pure returns (uint256) {
        return replicas >= 256 ? type(uint256).max : (uint256(1) << replicas) - 1;
    }

    function _popcount(uint256 x) internal pure returns (uint256 count) {
        for (; x != 0; x &= x - 1) {
            ++count;
        }
    }

    /// @dev Shapes are not exposed by the ledger; tests track them by run id.
    mapping(uint256 runId => uint32[2]) internal _shapes;

    function _shapeOf(uint256 runId) internal view returns (uint32 replicas, uint32 stages) {
        uint32[2] memory shape = _shapes[runId];
        if (shape[0] == 0) return (2, 2);
        return (shape[0], shape[1]);
    }

    function _commit(StepCall memory c) internal {
        ledger.commitStep(
            c.runId, c.step, c.parent, c.checkpoint, c.contributionsRoot, c.metricsDigest, c.replicaSet, c.attestations
        );
    }

    /// @dev Re-signs attestation `i` of `c` with `key` (after a field was changed).
    function _resign(StepCall memory c, uint256 i, uint256 key) internal view {
        (c.attestations[i].r, c.attestations[i].vs) =
            vm.signCompact(key, _digest(c.runId, c.step, c.parent, c.attestations[i]));
    }

    /// @dev A step record's witness hash: see {ITrainingLedger-StepInfo}.
    function _witness(address[] memory signers, bytes32 shardsRoot, uint256 replicaSet)
        internal
        pure
        returns (bytes20)
    {
        return bytes20(keccak256(abi.encode(keccak256(abi.encodePacked(signers)), shardsRoot, replicaSet)));
    }

    function _recover(StepCall memory c, uint256 i) internal view returns (address) {
        return
            ECDSA.recover(
                _digest(c.runId, c.step, c.parent, c.attestations[i]), c.attestations[i].r, c.attestations[i].vs
            );
    }
}
