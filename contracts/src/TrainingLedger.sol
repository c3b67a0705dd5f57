// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";
import {EIP712} from "@openzeppelin/contracts/utils/cryptography/EIP712.sol";

import {INodeRegistry} from "./interfaces/INodeRegistry.sol";
import {ITrainingLedger} from "./interfaces/ITrainingLedger.sol";

/// @title TrainingLedger
/// @notice Records the outer steps of DiLoCoX training runs as a chain of checkpoints, each
/// backed by one EIP-712 attestation per (replica, stage) slot from a staked member node.
/// @dev Signing domain: {name: "DiLoCoXLedger", version: "1", chainId, verifyingContract}.
/// Events carry everything a lineage query needs, so queries read logs, not storage.
/// `challengeWindow`, `arbiters` and `quorum` are stored for the challenge, finality and
/// slashing logic that extends {Run} and {StepRecord} later.
contract TrainingLedger is ITrainingLedger, EIP712 {
    /// @inheritdoc ITrainingLedger
    bytes32 public constant CONTRIBUTION_TYPEHASH = keccak256(
        "Contribution(uint256 runId,uint64 step,uint32 replica,uint32 stage,bytes32 parent,bytes32 contribution,bytes32 dataShard,bytes32 codeHash,int64 lossMicros)"
    );

    /// @dev The EIP-712 `Contribution` message, field for field; `abi.encode` of this static
    /// struct is its EIP-712 `encodeData`.
    struct Contribution {
        uint256 runId;
        uint64 step;
        uint32 replica;
        uint32 stage;
        bytes32 parent;
        bytes32 contribution;
        bytes32 dataShard;
        bytes32 codeHash;
        int64 lossMicros;
    }

    /// @dev One committed outer step; step 0 holds the genesis.
    struct StepRecord {
        bytes32 checkpoint;
        bytes32 parent;
        bytes32 metricsDigest;
        uint64 blockNumber;
    }

    /// @dev One training run. `creator`, the shape and `quorum` share a slot.
    struct Run {
        address creator;
        uint32 replicas;
        uint32 stages;
        uint32 quorum;
        uint64 headStep;
        uint64 challengeWindow;
        bytes32 configDigest;
        bytes32 head;
        uint256 minStake;
        address[] arbiters;
        mapping(address node => bool) members;
        mapping(uint64 step => StepRecord) steps;
    }

    INodeRegistry private immutable _registry;
    uint256 private _runCount;
    mapping(uint256 runId => Run) private _runs;

    /// @param registry_ The registry whose stakes back attestations.
    constructor(INodeRegistry registry_) EIP712("DiLoCoXLedger", "1") {
        _registry = registry_;
    }

    /// @inheritdoc ITrainingLedger
    function createRun(
        bytes32 configDigest,
        bytes32 genesisDigest,
        address[] calldata nodes,
        uint32 replicas,
        uint32 stages,
        uint64 challengeWindow,
        uint256 minStake,
        address[] calldata arbiters,
        uint32 quorum
    ) external returns (uint256 runId) {
        if (replicas == 0 || stages == 0) revert LedgerInvalidShape(replicas, stages);
        if (nodes.length == 0) revert LedgerNoNodes();
        if (quorum > arbiters.length || (quorum == 0 && arbiters.length != 0)) {
            revert LedgerInvalidQuorum(quorum, arbiters.length);
        }
        if (genesisDigest == bytes32(0)) revert LedgerZeroDigest();

        runId = ++_runCount;
        _storeRun(_runs[runId], configDigest, genesisDigest, replicas, stages, challengeWindow, minStake, quorum);
        _runs[runId].arbiters = arbiters;
        _addMembers(_runs[runId], nodes);
        _emitRunCreated(runId, nodes);
    }

    /// @inheritdoc ITrainingLedger
    function commitStep(
        uint256 runId,
        uint64 step,
        bytes32 parent,
        bytes32 checkpoint,
        bytes32 contributionsRoot,
        bytes32 metricsDigest,
        Attestation[] calldata attestations
    ) external {
        Run storage run = _existingRun(runId);
        uint64 expectedStep = run.headStep + 1;
        if (step != expectedStep) revert LedgerWrongStep(expectedStep, step);
        if (parent != run.head) revert LedgerStaleParent(run.head, parent);
        if (checkpoint == bytes32(0)) revert LedgerZeroDigest();
        address[] memory signers = _verifyAttestations(run, runId, step, parent, contributionsRoot, attestations);

        run.head = checkpoint;
        run.headStep = step;
        run.steps[step] = StepRecord({
            checkpoint: checkpoint, parent: parent, metricsDigest: metricsDigest, blockNumber: uint64(block.number)
        });
        emit StepCommitted(runId, step, checkpoint, parent, contributionsRoot, metricsDigest, msg.sender);
        for (uint256 i = 0; i < attestations.length; ++i) {
            Attestation calldata a = attestations[i];
            emit ContributionAttested(
                runId, step, signers[i], a.replica, a.stage, a.contribution, a.dataShard, a.codeHash, a.lossMicros
            );
        }
    }

    /// @inheritdoc ITrainingLedger
    function registry() external view returns (address) {
        return address(_registry);
    }

    /// @inheritdoc ITrainingLedger
    function runCount() external view returns (uint256) {
        return _runCount;
    }

    /// @inheritdoc ITrainingLedger
    function runHead(uint256 runId) external view returns (bytes32 head, uint64 step) {
        Run storage run = _existingRun(runId);
        return (run.head, run.headStep);
    }

    /// @inheritdoc ITrainingLedger
    function stepCheckpoint(uint256 runId, uint64 step) external view returns (bytes32) {
        return _existingRun(runId).steps[step].checkpoint;
    }

    /// @inheritdoc ITrainingLedger
    function isMember(uint256 runId, address node) external view returns (bool) {
        return _runs[runId].members[node];
    }

    /// @inheritdoc ITrainingLedger
    function contributionDigest(
        uint256 runId,
        uint64 step,
        uint32 replica,
        uint32 stage,
        bytes32 parent,
        bytes32 contribution,
        bytes32 dataShard,
        bytes32 codeHash,
        int64 lossMicros
    ) external view returns (bytes32) {
        Contribution memory message;
        message.runId = runId;
        message.step = step;
        message.replica = replica;
        message.stage = stage;
        message.parent = parent;
        message.contribution = contribution;
        message.dataShard = dataShard;
        message.codeHash = codeHash;
        message.lossMicros = lossMicros;
        return _contributionDigest(message);
    }

    /// @dev Writes a new run's parameters, with `genesisDigest` as its head at step 0.
    function _storeRun(
        Run storage run,
        bytes32 configDigest,
        bytes32 genesisDigest,
        uint32 replicas,
        uint32 stages,
        uint64 challengeWindow,
        uint256 minStake,
        uint32 quorum
    ) private {
        run.creator = msg.sender;
        run.replicas = replicas;
        run.stages = stages;
        run.quorum = quorum;
        run.challengeWindow = challengeWindow;
        run.configDigest = configDigest;
        run.head = genesisDigest;
        run.minStake = minStake;
        run.steps[0] = StepRecord({
            checkpoint: genesisDigest, parent: bytes32(0), metricsDigest: bytes32(0), blockNumber: uint64(block.number)
        });
    }

    /// @dev Makes each of `nodes` a member of `run`; reverts with {LedgerDuplicateNode} on a
    /// repeated node (the revert undoes the memberships already written).
    function _addMembers(Run storage run, address[] calldata nodes) private {
        for (uint256 i = 0; i < nodes.length; ++i) {
            if (run.members[nodes[i]]) revert LedgerDuplicateNode(nodes[i]);
            run.members[nodes[i]] = true;
        }
    }

    /// @dev Emits {RunCreated} from the stored run: createRun has too many parameters to
    /// emit it from its own stack frame without via-ir.
    function _emitRunCreated(uint256 runId, address[] calldata nodes) private {
        Run storage run = _runs[runId];
        emit RunCreated(runId, run.creator, run.configDigest, run.steps[0].checkpoint, run.replicas, run.stages, nodes);
    }

    /// @dev Checks the attestations against the run and `contributionsRoot`; returns the
    /// signer of each, in slot order.
    function _verifyAttestations(
        Run storage run,
        uint256 runId,
        uint64 step,
        bytes32 parent,
        bytes32 contributionsRoot,
        Attestation[] calldata attestations
    ) private view returns (address[] memory signers) {
        uint32 stages = run.stages;
        uint256 slots = uint256(run.replicas) * stages;
        if (attestations.length != slots) revert LedgerWrongAttestationCount(slots, attestations.length);

        uint256 required = run.minStake == 0 ? 1 : run.minStake;
        signers = new address[](slots);
        bytes32[] memory contributions = new bytes32[](slots);
        for (uint256 i = 0; i < slots; ++i) {
            Attestation calldata a = attestations[i];
            // replica * stages + stage == i with stage < stages pins replica < replicas too.
            if (a.stage >= stages || uint256(a.replica) * stages + a.stage != i) {
                revert LedgerSlotOutOfOrder(i, a.replica, a.stage);
            }
            address signer = _attestationSigner(runId, step, parent, a);
            if (!run.members[signer]) revert LedgerNotMember(runId, signer);
            uint256 staked = _registry.stakeOf(signer);
            if (staked < required) revert LedgerInsufficientStake(signer, staked, required);
            signers[i] = signer;
            contributions[i] = a.contribution;
        }

        // abi.encodePacked of a bytes32[] is its elements back to back, without a length.
        bytes32 expectedRoot = keccak256(abi.encodePacked(contributions));
        if (contributionsRoot != expectedRoot) revert LedgerContributionsRootMismatch(expectedRoot, contributionsRoot);
    }

    /// @dev The key that signed `a` for step `step` of run `runId` on top of `parent`.
    /// Reverts with OpenZeppelin's ECDSA errors on a malformed signature.
    function _attestationSigner(uint256 runId, uint64 step, bytes32 parent, Attestation calldata a)
        private
        view
        returns (address)
    {
        Contribution memory message;
        message.runId = runId;
        message.step = step;
        message.replica = a.replica;
        message.stage = a.stage;
        message.parent = parent;
        message.contribution = a.contribution;
        message.dataShard = a.dataShard;
        message.codeHash = a.codeHash;
        message.lossMicros = a.lossMicros;
        return ECDSA.recover(_contributionDigest(message), a.signature);
    }

    /// @dev The EIP-712 digest of `message` in this ledger's domain.
    function _contributionDigest(Contribution memory message) private view returns (bytes32) {
        return _hashTypedDataV4(keccak256(abi.encode(CONTRIBUTION_TYPEHASH, message)));
    }

    /// @dev The run with id `runId`; reverts with {LedgerUnknownRun} if there is none.
    function _existingRun(uint256 runId) private view returns (Run storage run) {
        if (runId == 0 || runId > _runCount) revert LedgerUnknownRun(runId);
        return _runs[runId];
    }
}
