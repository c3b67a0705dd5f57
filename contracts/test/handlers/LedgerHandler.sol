// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {CommonBase} from "forge-std/Base.sol";
import {StdUtils} from "forge-std/StdUtils.sol";

import {NodeRegistry} from "../../src/NodeRegistry.sol";
import {TrainingLedger} from "../../src/TrainingLedger.sol";
import {ITrainingLedger} from "../../src/interfaces/ITrainingLedger.sol";

/// @notice Drives a registry and ledger pair through a whole run's life: commits (of both
/// replicas or of one: the run needs one of its two), equivocation reports, challenges with
/// arbiter verdicts, finality with rewards paid from the run's pool (funded by anyone),
/// unbonding, withdrawals and claims. Every action is valid (or
/// caught where the point is that it must fail), and ghost variables track what the
/// invariants compare against.
contract LedgerHandler is CommonBase, StdUtils {
    uint256 public constant MIN_STAKE = 1 ether;
    uint64 public constant WINDOW = 50;
    bytes32 public constant GENESIS = keccak256("genesis");

    NodeRegistry public immutable registry;
    TrainingLedger public immutable ledger;
    uint256 public immutable runId;

    uint256[] internal _nodeKeys;
    address[] internal _nodes;
    uint256[] internal _arbiterKeys;
    address public immutable verifier;
    address[] internal _payees;

    /// @dev The signers of each step's current record, the shards it co-signed and its
    /// replica set, for challenges.
    mapping(uint64 step => address[]) internal _signers;
    mapping(uint64 step => bytes32[]) internal _shards;
    mapping(uint64 step => uint256) internal _sets;
    uint256[] internal _openChallenges;
    uint256 internal _nonce;

    uint256 public ghost_in;
    uint256 public ghost_out;
    uint256 public ghost_bonds;
    uint256 public ghost_slashes;
    uint256 public ghost_doubleSlashes;
    uint256 public ghost_rollbacks;
    uint256 public ghost_ineligibleAccepted;
    uint256 public ghost_ineligibleRefused;
    uint256 public ghost_dependentAccepted;
    uint256 public ghost_badSetAccepted;
    uint256 public ghost_partialCommits;
    uint256 public ghost_doublePaid;
    uint256 public ghost_paidEarly;
    uint256 public ghost_rewardsPaid;
    uint256 public ghost_funded;
    uint256 public ghost_slashIncome;
    mapping(uint64 step => uint256) public ghost_paidTimes;
    /// @dev Every step made final, with its checkpoint at that moment.
    uint64[] public ghost_finalSteps;
    mapping(uint64 step => bytes32) public ghost_finalCheckpoint;
    mapping(address node => uint256) public ghost_openChallengesAgainst;
    /// @dev The witness hash each step's current record must keep: what the handler committed.
    mapping(uint64 step => bytes20) public ghost_witness;

    constructor() {
        registry = new NodeRegistry(vm.addr(0xdead), 5_000, 1 days);
        ledger = new TrainingLedger(registry);
        registry.bindLedger(address(ledger));

        for (uint256 i = 0; i < 4; ++i) {
            _nodeKeys.push(0xA000 + i);
            _nodes.push(vm.addr(0xA000 + i));
            _payees.push(_operator(i));
            // Rewards are credited to the node keys.
            _payees.push(_nodes[i]);
            vm.prank(_nodes[i]);
            registry.register(_operator(i));
            _stakeFor(i, MIN_STAKE);
        }
        address[] memory arbiters = new address[](3);
        for (uint256 i = 0; i < 3; ++i) {
            _arbiterKeys.push(0xB000 + i);
            arbiters[i] = vm.addr(0xB000 + i);
        }
        verifier = vm.addr(0xC000);
        vm.prank(verifier);
        registry.register(verifier);
        vm.deal(verifier, 1_000 ether);
        vm.prank(verifier);
        registry.stake{value: MIN_STAKE}(verifier);
        ghost_in += MIN_STAKE;
        _payees.push(verifier);
        _payees.push(vm.addr(0xdead));
        // Equivocation reports come from this handler, which is paid the reporter's share.
        _payees.push(address(this));

        vm.deal(address(this), 10 ether);
        runId = ledger.createRun{value: 2 ether}(
            ITrainingLedger.RunSpec({
                configDigest: keccak256("config"),
                genesisDigest: GENESIS,
                nodes: _nodes,
                replicas: 2,
                stages: 2,
                minReplicas: 1,
                challengeWindow: WINDOW,
                minStake: MIN_STAKE,
                arbiters: arbiters,
                quorum: 2,
                independence: 0,
                admission: uint8(ITrainingLedger.Admission.Open),
                rewardPerStep: REWARD
            })
        );
        ghost_in += 2 ether;
        ghost_funded += 2 ether;
    }

    /// @dev A step's reward; a pool of 2 ether pays about 6 steps before funding runs low.
    uint128 public constant REWARD = 0.3 ether;

    /// @dev Claims of the reporter's share land here.
    receive() external payable {}

    // ---------------------------------------------------------------- views for invariants

    function nodes() external view returns (address[] memory) {
        return _nodes;
    }

    function payees() external view returns (address[] memory) {
        return _payees;
    }

    function finalStepCount() external view returns (uint256) {
        return ghost_finalSteps.length;
    }

    // ---------------------------------------------------------------- actions

    /// @notice Commits the next step over both replicas or (one seed in two) over one of
    /// them, each slot signed by an eligible member (topping up a member whose stake was
    /// slashed, unless it is unbonding).
    function commit(uint256 seed) external {
        uint256 set = seed % 4 < 2 ? 3 : seed % 4 - 1; // {0, 1}, {0} or {1}
        (address[] memory signers, uint256[] memory signerKeys) = _pickSigners(seed, set == 3 ? 4 : 2);
        if (signers.length == 0) return;
        (uint64 step, bytes32 head, ITrainingLedger.Attestation[] memory atts, bytes32 root) =
            _nextAttestations(signerKeys, set, bytes32(++_nonce));
        bytes32 checkpoint = keccak256(abi.encode("checkpoint", step, _nonce));
        ledger.commitStep(runId, step, head, checkpoint, root, bytes32(0), set, atts);
        if (set != 3) ghost_partialCommits += 1;
        _signers[step] = signers;
        _sets[step] = set;
        bytes32[] memory shards = new bytes32[](2);
        (shards[0], shards[1]) = (atts[0].newShard, atts[1].newShard);
        _shards[step] = shards;
        ghost_witness[step] = bytes20(
            keccak256(abi.encode(keccak256(abi.encodePacked(signers)), keccak256(abi.encodePacked(shards)), set))
        );
    }

    /// @dev The attestations of the step after the head over `set` ({0, 1}, {0} or {1}),
    /// slot i signed by `signerKeys[i]`, and their contributions root.
    function _nextAttestations(uint256[] memory signerKeys, uint256 set, bytes32 salt)
        internal
        view
        returns (uint64 step, bytes32 head, ITrainingLedger.Attestation[] memory atts, bytes32 root)
    {
        uint64 headStep;
        (head, headStep) = ledger.runHead(runId);
        step = headStep + 1;
        atts = new ITrainingLedger.Attestation[](signerKeys.length);
        bytes memory packed;
        for (uint256 slot = 0; slot < atts.length; ++slot) {
            uint32 replica = set == 2 ? 1 : uint32(slot / 2);
            atts[slot] = _attest(signerKeys[slot], step, head, replica, uint32(slot % 2), set, salt);
            packed = bytes.concat(packed, atts[slot].contribution);
        }
        root = keccak256(packed);
    }

    /// @dev An eligible, not unbonding member per slot (topping up a slashed stake), the
    /// replicas' signers distinct; empty if there are not enough.
    function _pickSigners(uint256 seed, uint256 slots)
        internal
        returns (address[] memory signers, uint256[] memory signerKeys)
    {
        signers = new address[](slots);
        signerKeys = new uint256[](slots);
        for (uint256 slot = 0; slot < slots; ++slot) {
            bool found = false;
            for (uint256 k = 0; k < 4 && !found; ++k) {
                uint256 i = (slot + k + seed % 4) % 4;
                (, uint64 releaseAt) = registry.unbondingOf(_nodes[i]);
                if (releaseAt != 0) continue;
                if (registry.stakeOf(_nodes[i]) < MIN_STAKE) _stakeFor(i, MIN_STAKE);
                signers[slot] = _nodes[i];
                signerKeys[slot] = _nodeKeys[i];
                found = true;
            }
            if (!found) return (new address[](0), new uint256[](0));
        }
        // Replicas are independent witnesses: a node in both would be refused.
        for (uint256 slot = 0; slots == 4 && slot < 2; ++slot) {
            if (signers[slot] == signers[2] || signers[slot] == signers[3]) return (new address[](0), new uint256[](0));
        }
    }

    /// @notice Tries to commit the next step with a replica set the attestations do not
    /// match, or one the run does not allow: no replica; a replica the run does not have; a
    /// present replica without its last stage; an attestation for a replica outside the set;
    /// an attestation signed over another set. Each must be refused with its own error,
    /// whatever the signers' stakes.
    function commitBadSet(uint256 seed) external {
        (bytes32 head, uint64 headStep) = ledger.runHead(runId);
        uint64 step = headStep + 1;
        uint256 kind = seed % 5;
        uint256[5] memory sets = [uint256(0), 5, 3, 1, 1];
        uint256[5] memory counts = [uint256(0), 4, 3, 2, 2];
        bytes4[5] memory errors = [
            ITrainingLedger.LedgerTooFewReplicas.selector,
            ITrainingLedger.LedgerReplicaSetOutOfRange.selector,
            ITrainingLedger.LedgerMissingStage.selector,
            ITrainingLedger.LedgerReplicaNotInSet.selector,
            ITrainingLedger.LedgerReplicaSetMismatch.selector
        ];
        ITrainingLedger.Attestation[] memory atts = new ITrainingLedger.Attestation[](counts[kind]);
        bytes memory packed;
        for (uint256 slot = 0; slot < atts.length; ++slot) {
            // kind 3: slot 1 claims replica 1, outside {0}; kind 4: slot 1 signs over {0, 1}.
            uint32 replica = kind == 3 && slot == 1 ? 1 : uint32(slot / 2);
            uint256 signedSet = kind == 4 && slot == 1 ? 3 : sets[kind];
            atts[slot] = _attest(_nodeKeys[slot], step, head, replica, uint32(slot % 2), signedSet, bytes32(_nonce));
            packed = bytes.concat(packed, atts[slot].contribution);
        }
        try ledger.commitStep(runId, step, head, keccak256(abi.encode("bad set", seed)), keccak256(packed), 0, sets[kind], atts) {
            ghost_badSetAccepted += 1;
        } catch (bytes memory reason) {
            if (bytes4(reason) != errors[kind]) ghost_badSetAccepted += 1;
        }
    }

    /// @notice Tries to commit the next step with one slot signed by a member whose active
    /// stake is below the minimum (slashed or unbonding): it must be refused, whatever the
    /// ledger cached about earlier signer lists.
    function commitIneligible(uint256 seed) external {
        uint256 bad = type(uint256).max;
        for (uint256 k = 0; k < 4; ++k) {
            uint256 i = (k + seed % 4) % 4;
            if (registry.stakeOf(_nodes[i]) < MIN_STAKE) {
                bad = i;
                break;
            }
        }
        if (bad == type(uint256).max) return;
        (bytes32 head, uint64 headStep) = ledger.runHead(runId);
        uint64 step = headStep + 1;
        ITrainingLedger.Attestation[] memory atts = new ITrainingLedger.Attestation[](4);
        bytes memory packed;
        for (uint256 slot = 0; slot < 4; ++slot) {
            uint256 key = slot == seed % 4 ? _nodeKeys[bad] : _nodeKeys[slot];
            atts[slot] = _attest(key, step, head, uint32(slot / 2), uint32(slot % 2), 3, bytes32(_nonce));
            packed = bytes.concat(packed, atts[slot].contribution);
        }
        try ledger.commitStep(runId, step, head, keccak256(abi.encode(seed)), keccak256(packed), 0, 3, atts) {
            ghost_ineligibleAccepted += 1;
        } catch (bytes memory reason) {
            // Refused, and for the right reason.
            if (bytes4(reason) != ITrainingLedger.LedgerInsufficientStake.selector) ghost_ineligibleAccepted += 1;
            ghost_ineligibleRefused += 1;
        }
    }

    /// @notice Tries to commit the next step with one node signing a slot of each replica: it
    /// must be refused, as not independent (or, if that node lost its stake, as ineligible),
    /// whatever the ledger cached about earlier signer lists.
    function commitNotIndependent(uint256 seed) external {
        (bytes32 head, uint64 headStep) = ledger.runHead(runId);
        uint64 step = headStep + 1;
        uint256 twice = seed % 4;
        ITrainingLedger.Attestation[] memory atts = new ITrainingLedger.Attestation[](4);
        bytes memory packed;
        for (uint256 slot = 0; slot < 4; ++slot) {
            // Slot (1, s) signed by the node of slot (0, s) for the chosen stage.
            uint256 key = slot == 2 + twice % 2 ? _nodeKeys[twice % 2] : _nodeKeys[slot];
            atts[slot] = _attest(key, step, head, uint32(slot / 2), uint32(slot % 2), 3, bytes32(_nonce));
            packed = bytes.concat(packed, atts[slot].contribution);
        }
        try ledger.commitStep(
            runId, step, head, keccak256(abi.encode("dependent", seed)), keccak256(packed), 0, 3, atts
        ) {
            ghost_dependentAccepted += 1;
        } catch (bytes memory reason) {
            bytes4 selector = bytes4(reason);
            if (
                selector != ITrainingLedger.LedgerNotIndependent.selector
                    && selector != ITrainingLedger.LedgerInsufficientStake.selector
            ) ghost_dependentAccepted += 1;
        }
    }

    /// @notice Reports an equivocation by the node of a slot: two contributions drawn from a
    /// tiny set, so the same offence comes up again and must not be slashed again.
    function equivocate(uint256 nodeSeed, uint256 stepSeed, uint256 x, uint256 y) external {
        uint256 i = bound(nodeSeed, 0, 3);
        uint64 step = uint64(bound(stepSeed, 1, 3));
        if (bound(x, 1, 3) == bound(y, 1, 3)) return;
        // Either set: the offence is the slot's, whatever set both were signed over.
        uint256 set = x % 2 == 0 ? 1 : 3;
        ITrainingLedger.Attestation memory first =
            _attest(_nodeKeys[i], step, GENESIS, 0, 0, set, bytes32(bound(x, 1, 3)));
        ITrainingLedger.Attestation memory second =
            _attest(_nodeKeys[i], step, GENESIS, 0, 0, set, bytes32(bound(y, 1, 3)));
        bytes32 offence = ledger.offenceId(0, runId, step, 0, 0, GENESIS, _nodes[i]);
        bool before = ledger.isSlashed(offence);
        try ledger.reportEquivocation(runId, step, GENESIS, first, second) {
            if (before) ghost_doubleSlashes += 1;
            ghost_slashes += 1;
        } catch (bytes memory reason) {
            // The only allowed failure: the offence was slashed already.
            bytes4 selector = bytes4(reason);
            if (!before || selector != ITrainingLedger.LedgerAlreadySlashed.selector) ghost_doubleSlashes += 100;
        }
    }

    /// @notice Reports a result equivocation by the node of a slot: two shard digests drawn
    /// from a tiny set, so the same offence comes up again and must not be slashed again.
    function equivocateResult(uint256 nodeSeed, uint256 stepSeed, uint256 x, uint256 y) external {
        uint256 i = bound(nodeSeed, 0, 3);
        uint64 step = uint64(bound(stepSeed, 1, 3));
        bytes32 a = bytes32(bound(x, 1, 3));
        bytes32 b = bytes32(bound(y, 1, 3));
        if (a == b) return;
        ITrainingLedger.Attestation memory first = _attest(_nodeKeys[i], step, GENESIS, 0, 1, 3, a);
        ITrainingLedger.Attestation memory second = _attest(_nodeKeys[i], step, GENESIS, 1, 1, 3, b);
        bytes32 offence = ledger.offenceId(3, runId, step, type(uint32).max, 1, GENESIS, _nodes[i]);
        bool before = ledger.isSlashed(offence);
        try ledger.reportResultEquivocation(runId, step, GENESIS, first, second) {
            if (before) ghost_doubleSlashes += 1;
            ghost_slashes += 1;
        } catch (bytes memory reason) {
            bytes4 selector = bytes4(reason);
            if (!before || selector != ITrainingLedger.LedgerAlreadySlashed.selector) ghost_doubleSlashes += 100;
        }
    }

    /// @notice The verifier challenges the co-signed shard of a stage of a challengeable step.
    function challengeAggregate(uint256 stepSeed, uint256 stageSeed) external {
        (, uint64 headStep) = ledger.runHead(runId);
        uint64 finalized = ledger.finalizedStep(runId);
        if (headStep <= finalized) return;
        uint64 step = uint64(bound(stepSeed, finalized + 1, headStep));
        ITrainingLedger.StepInfo memory info = ledger.stepInfo(runId, step);
        if (block.timestamp > info.committedAt + WINDOW) return;
        uint32 stage = uint32(bound(stageSeed, 0, 1));
        vm.prank(verifier);
        ledger.openAggregateChallenge{value: MIN_STAKE}(runId, step, stage, _sets[step], _signers[step], _shards[step], 0);
        _openChallenges.push(ledger.challengeCount());
        ghost_in += MIN_STAKE;
        ghost_bonds += MIN_STAKE;
        // One co-signer per replica of the step's set.
        for (uint256 slot = stage; slot < _signers[step].length; slot += 2) {
            ghost_openChallengesAgainst[_signers[step][slot]] += 1;
        }
    }

    /// @notice The verifier challenges a slot of a challengeable step.
    function challenge(uint256 stepSeed, uint256 slotSeed) external {
        (, uint64 headStep) = ledger.runHead(runId);
        uint64 finalized = ledger.finalizedStep(runId);
        if (headStep <= finalized) return;
        uint64 step = uint64(bound(stepSeed, finalized + 1, headStep));
        ITrainingLedger.StepInfo memory info = ledger.stepInfo(runId, step);
        if (block.timestamp > info.committedAt + WINDOW) return;
        uint256 slot = bound(slotSeed, 0, _signers[step].length - 1);
        // The slot's replica: its position in the set, or the one replica of a partial step.
        uint256 set = _sets[step];
        uint32 replica = set == 3 ? uint32(slot / 2) : (set == 1 ? 0 : 1);
        vm.prank(verifier);
        bytes32 root = keccak256(abi.encodePacked(_shards[step]));
        ledger.openChallenge{value: MIN_STAKE}(runId, step, replica, uint32(slot % 2), set, _signers[step], root, 0);
        _openChallenges.push(ledger.challengeCount());
        ghost_in += MIN_STAKE;
        ghost_bonds += MIN_STAKE;
        ghost_openChallengesAgainst[_signers[step][slot]] += 1;
    }

    /// @notice Two arbiters rule on an open challenge.
    function resolve(uint256 idSeed, bool upheld) external {
        if (_openChallenges.length == 0) return;
        uint256 id = _takeOpenChallenge(idSeed);

        ITrainingLedger.Challenge memory c = ledger.challenge(id);
        address[] memory held = _held(c, id);
        bool[] memory before = new bool[](held.length);
        uint256[] memory stakeBefore = new uint256[](held.length);
        for (uint256 i = 0; i < held.length; ++i) {
            before[i] = ledger.isSlashed(_offence(c, i, held[i]));
            stakeBefore[i] = _stakeTotal(held[i]);
        }
        (, uint64 headBefore) = ledger.runHead(runId);

        ledger.resolveChallenge(id, upheld, _verdicts(id, upheld));

        for (uint256 i = 0; i < held.length; ++i) {
            if (upheld && !before[i]) ghost_slashes += 1;
            if (before[i] && _stakeTotal(held[i]) != stakeBefore[i]) ghost_doubleSlashes += 1;
            if (upheld && !ledger.isSlashed(_offence(c, i, held[i]))) ghost_doubleSlashes += 100;
            ghost_openChallengesAgainst[held[i]] -= 1;
        }
        (, uint64 headAfter) = ledger.runHead(runId);
        if (headAfter < headBefore) ghost_rollbacks += 1;
        ghost_bonds -= c.bond;
    }

    /// @dev The nodes challenge `id` holds: its co-signers (aggregate) or its node.
    function _held(ITrainingLedger.Challenge memory c, uint256 id) internal view returns (address[] memory held) {
        if (c.aggregate) return ledger.coSignersOf(id);
        held = new address[](1);
        held[0] = c.node;
    }

    /// @dev The offence an upheld challenge `c` charges its `i`-th held node with.
    function _offence(ITrainingLedger.Challenge memory c, uint256 i, address node) internal view returns (bytes32) {
        bytes32 epoch = bytes32(uint256(c.epoch));
        if (c.aggregate) return ledger.offenceId(2, runId, c.step, uint32(i), c.stage, epoch, node);
        return ledger.offenceId(1, runId, c.step, c.replica, c.stage, epoch, node);
    }

    function _stakeTotal(address node) internal view returns (uint256) {
        (uint256 unbonding,) = registry.unbondingOf(node);
        return registry.stakeOf(node) + unbonding;
    }

    /// @notice Nobody rules on an open challenge within the resolution period: it expires.
    function expire(uint256 idSeed) external {
        if (_openChallenges.length == 0) return;
        uint256 id = _takeOpenChallenge(idSeed);

        ITrainingLedger.Challenge memory c = ledger.challenge(id);
        uint256 deadline = uint256(c.openedAt) + ledger.resolutionPeriod();
        if (block.timestamp <= deadline) vm.warp(deadline + 1);
        ledger.expireChallenge(id);
        ghost_bonds -= c.bond;
        address[] memory held = _held(c, id);
        for (uint256 i = 0; i < held.length; ++i) {
            ghost_openChallengesAgainst[held[i]] -= 1;
        }
    }

    /// @notice Finalizes the next step if its window passed and nothing holds it.
    function finalize(uint256 waitSeed) external {
        (, uint64 headStep) = ledger.runHead(runId);
        uint64 step = ledger.finalizedStep(runId) + 1;
        if (step > headStep) return;
        ITrainingLedger.StepInfo memory info = ledger.stepInfo(runId, step);
        if (info.openChallenges != 0) return;
        uint256 deadline = info.committedAt + WINDOW;
        if (block.timestamp <= deadline) {
            if (waitSeed % 2 == 0) return;
            vm.warp(deadline + 1);
        }
        _finalizeAndPay(step, info);
        ghost_finalSteps.push(step);
        ghost_finalCheckpoint[step] = info.checkpoint;
    }

    /// @notice Tries to finalize (and so pay) the next step before its window closes: the
    /// ledger must refuse.
    function finalizeEarly() external {
        (, uint64 headStep) = ledger.runHead(runId);
        uint64 step = ledger.finalizedStep(runId) + 1;
        if (step > headStep) return;
        ITrainingLedger.StepInfo memory info = ledger.stepInfo(runId, step);
        if (block.timestamp > info.committedAt + WINDOW) return;
        try ledger.finalizeSteps(runId, _witnessOf(step)) {
            ghost_paidEarly += 1;
        } catch {}
    }

    /// @notice Anyone adds to the run's pool.
    function fund(uint256 amount) external {
        amount = bound(amount, 1, 1 ether);
        vm.deal(address(this), address(this).balance + amount);
        ledger.fundRun{value: amount}(runId);
        ghost_in += amount;
        ghost_funded += amount;
    }

    /// @dev Finalizes `step` through finalizeSteps and checks what each signer was paid.
    function _finalizeAndPay(uint64 step, ITrainingLedger.StepInfo memory info) internal {
        ITrainingLedger.StepWitness[] memory w = _witnessOf(step);
        address[] memory signers = w[0].signers;
        uint256[] memory before = new uint256[](signers.length);
        for (uint256 i = 0; i < signers.length; ++i) {
            before[i] = registry.creditOf(signers[i]);
        }
        (uint256 pool,) = registry.poolOf(runId);
        uint256 creditsBefore = registry.totalCredits();
        ledger.finalizeSteps(runId, w);
        if (block.timestamp <= info.committedAt + WINDOW) ghost_paidEarly += 1;
        if (ghost_paidTimes[step] != 0) ghost_doublePaid += 1;
        ghost_paidTimes[step] += 1;
        uint256 share = (pool < REWARD ? pool : REWARD) / signers.length;
        for (uint256 i = 0; i < signers.length; ++i) {
            // A node is paid at most one share per slot it signed.
            uint256 slots;
            for (uint256 j = 0; j < signers.length; ++j) {
                if (signers[j] == signers[i]) ++slots;
            }
            uint256 got = registry.creditOf(signers[i]) - before[i];
            if (got > share * slots || (share != 0 && got % share != 0)) ghost_doublePaid += 1;
        }
        uint256 paid = registry.totalCredits() - creditsBefore;
        if (paid > share * signers.length) ghost_doublePaid += 1;
        ghost_rewardsPaid += paid;
    }

    /// @dev The witness of `step`'s current record, as finalizeSteps takes it.
    function _witnessOf(uint64 step) internal view returns (ITrainingLedger.StepWitness[] memory w) {
        w = new ITrainingLedger.StepWitness[](1);
        w[0] = ITrainingLedger.StepWitness({
            signers: _signers[step], shardsRoot: keccak256(abi.encodePacked(_shards[step])), replicaSet: _sets[step]
        });
    }

    function unbond(uint256 nodeSeed) external {
        uint256 i = bound(nodeSeed, 0, 3);
        (, uint64 releaseAt) = registry.unbondingOf(_nodes[i]);
        if (releaseAt != 0 || registry.stakeOf(_nodes[i]) == 0) return;
        vm.prank(_operator(i));
        registry.unbond(_nodes[i]);
    }

    function withdraw(uint256 nodeSeed) external {
        uint256 i = bound(nodeSeed, 0, 3);
        (uint256 amount, uint64 releaseAt) = registry.unbondingOf(_nodes[i]);
        if (releaseAt == 0 || registry.openChallengesOf(_nodes[i]) != 0) return;
        if (block.timestamp < releaseAt) vm.warp(releaseAt);
        vm.prank(_operator(i));
        registry.withdraw(_nodes[i]);
        ghost_out += amount;
    }

    function claim(uint256 payeeSeed) external {
        address payee = _payees[bound(payeeSeed, 0, _payees.length - 1)];
        uint256 amount = registry.creditOf(payee);
        if (amount == 0) return;
        vm.prank(payee);
        registry.claim();
        ghost_out += amount;
    }

    function warp(uint256 seconds_) external {
        vm.warp(block.timestamp + bound(seconds_, 1, 2 * WINDOW));
    }

    // ---------------------------------------------------------------- helpers

    /// @dev Removes and returns one of the open challenges (there must be one).
    function _takeOpenChallenge(uint256 seed) internal returns (uint256 id) {
        uint256 index = bound(seed, 0, _openChallenges.length - 1);
        id = _openChallenges[index];
        _openChallenges[index] = _openChallenges[_openChallenges.length - 1];
        _openChallenges.pop();
    }

    function _operator(uint256 i) internal pure returns (address) {
        return vm.addr(0xE000 + i);
    }

    function _stakeFor(uint256 i, uint256 amount) internal {
        address operator = _operator(i);
        vm.deal(operator, operator.balance + amount);
        vm.prank(operator);
        registry.stake{value: amount}(_nodes[i]);
        ghost_in += amount;
    }

    function _attest(uint256 key, uint64 step, bytes32 parent, uint32 replica, uint32 stage, uint256 set, bytes32 salt)
        internal
        view
        returns (ITrainingLedger.Attestation memory a)
    {
        a.replica = replica;
        a.stage = stage;
        a.replicaSet = set;
        a.contribution = keccak256(abi.encode(salt, step, replica, stage));
        a.dataShard = keccak256(abi.encode("shard", step, replica));
        a.codeHash = keccak256("code");
        a.lossMicros = -1;
        a.newShard = keccak256(abi.encode("new shard", salt, step, stage));
        // equivocateResult draws tiny salts; commits use the nonce, which never repeats.
        (a.r, a.vs) = vm.signCompact(key, ledger.contributionDigest(runId, step, parent, a));
    }

    /// @dev Verdicts by the first two arbiters, sorted by address.
    function _verdicts(uint256 id, bool upheld) internal view returns (bytes[] memory sigs) {
        bytes32 digest = ledger.verdictDigest(id, upheld);
        (uint256 k0, uint256 k1) = (_arbiterKeys[0], _arbiterKeys[1]);
        if (vm.addr(k0) > vm.addr(k1)) (k0, k1) = (k1, k0);
        sigs = new bytes[](2);
        (uint8 v, bytes32 r, bytes32 s) = vm.sign(k0, digest);
        sigs[0] = abi.encodePacked(r, s, v);
        (v, r, s) = vm.sign(k1, digest);
        sigs[1] = abi.encodePacked(r, s, v);
    }
}
