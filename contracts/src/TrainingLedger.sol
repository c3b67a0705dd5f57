// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";
import {EIP712} from "@openzeppelin/contracts/utils/cryptography/EIP712.sol";

import {INodeRegistry} from "./interfaces/INodeRegistry.sol";
import {ITrainingLedger} from "./interfaces/ITrainingLedger.sol";

/// @title TrainingLedger
/// @notice Records the outer steps of DiLoCoX training runs as a chain of checkpoints, each
/// backed by one EIP-712 attestation per (replica, stage) slot from a staked member node;
/// slashes equivocating nodes on proof, lets staked verifiers challenge a step's replay
/// before an arbiter quorum, rolls the head back past rejected steps, and finalizes steps
/// whose challenge window passed.
/// @dev Signing domain: {name: "DiLoCoXLedger", version: "1", chainId, verifyingContract}.
/// Events carry everything a lineage query needs, so queries read logs, not storage.
///
/// Step records are stored by step number. A rollback to step k-1 marks steps k..head
/// rejected and bumps the run's epoch; a later commit of step k overwrites the record with
/// the new epoch, so a challenge (which remembers the epoch it was opened against) can tell
/// whether the record it disputes is still the one on the chain.
///
/// Finality runs in order: step k is final only after step k-1, after its own window, and
/// with no open challenge against it. A challenge needs a non-final step, so a final step
/// can never be rejected, and nor can any of its ancestors.
contract TrainingLedger is ITrainingLedger, EIP712 {
    /// @inheritdoc ITrainingLedger
    bytes32 public constant CONTRIBUTION_TYPEHASH = keccak256(
        "Contribution(uint256 runId,uint64 step,uint32 replica,uint32 stage,bytes32 parent,bytes32 contribution,bytes32 dataShard,bytes32 codeHash,int64 lossMicros)"
    );

    /// @inheritdoc ITrainingLedger
    bytes32 public constant VERDICT_TYPEHASH = keccak256("Verdict(uint256 challengeId,bool upheld)");

    uint8 private constant _EQUIVOCATION = 0;
    uint8 private constant _FAILED_REPLAY = 1;

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

    /// @dev The signer list whose eligibility was last checked in full for a run (the first
    /// 24 bytes of its hash, collision-resistant to 2^96 work), and the registry's
    /// {INodeRegistry-stakeDecreases} at that moment; one slot. See {_checkEligible}.
    struct EligibleSigners {
        bytes24 signers;
        uint64 atDecreases;
    }

    /// @dev One training run. `creator`, the shape and `quorum` share a slot; so do the
    /// head, the window, the final step and the epoch. The head checkpoint is
    /// `steps[headStep].checkpoint`.
    struct Run {
        address creator;
        uint32 replicas;
        uint32 stages;
        uint32 quorum;
        uint64 headStep;
        uint64 challengeWindow;
        uint64 finalizedStep;
        uint32 epoch;
        bytes32 configDigest;
        uint256 minStake;
        address[] arbiters;
        EligibleSigners eligible;
        mapping(address node => bool) members;
        mapping(address arbiter => bool) isArbiter;
        mapping(uint64 step => StepInfo) steps;
    }

    INodeRegistry private immutable _registry;
    uint64 private immutable _maxChallengeWindow;
    uint64 private immutable _resolutionPeriod;
    uint256 private _runCount;
    uint256 private _challengeCount;
    mapping(uint256 runId => Run) private _runs;
    mapping(uint256 challengeId => Challenge) private _challenges;
    mapping(bytes32 offence => bool) private _slashed;

    /// @param registry_ The registry whose stakes back attestations; it must bind this
    /// ledger ({INodeRegistry-bindLedger}) before slashing and challenges work.
    constructor(INodeRegistry registry_) EIP712("DiLoCoXLedger", "1") {
        _registry = registry_;
        // Every window stays strictly below the unbonding delay (see NodeRegistry).
        _maxChallengeWindow = registry_.unbondingDelay() - 1;
        _resolutionPeriod = registry_.unbondingDelay();
    }

    // ------------------------------------------------------------------------ runs and steps

    /// @inheritdoc ITrainingLedger
    function createRun(
        bytes32 configDigest,
        bytes32 genesisDigest,
        address[] calldata nodes,
        uint32 replicas,
        uint32 stages,
        uint64 challengeWindow_,
        uint256 minStake,
        address[] calldata arbiters,
        uint32 quorum
    ) external returns (uint256 runId) {
        if (replicas == 0 || stages == 0) revert LedgerInvalidShape(replicas, stages);
        if (nodes.length == 0) revert LedgerNoNodes();
        if (quorum > arbiters.length || (quorum == 0 && arbiters.length != 0)) {
            revert LedgerInvalidQuorum(quorum, arbiters.length);
        }
        if (challengeWindow_ > _maxChallengeWindow) revert LedgerWindowTooLong(challengeWindow_, _maxChallengeWindow);
        if (genesisDigest == bytes32(0)) revert LedgerZeroDigest();

        runId = ++_runCount;
        Run storage run = _runs[runId];
        _storeRun(run, configDigest, genesisDigest, replicas, stages, challengeWindow_, minStake, quorum);
        _addMembers(run, nodes);
        _addArbiters(run, arbiters);
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
        uint64 headStep = run.headStep;
        if (step != headStep + 1) revert LedgerWrongStep(headStep + 1, step);
        bytes32 head = run.steps[headStep].checkpoint;
        if (parent != head) revert LedgerStaleParent(head, parent);
        if (checkpoint == bytes32(0)) revert LedgerZeroDigest();
        (address[] memory signers, bytes32 signersHash) =
            _verifyAttestations(run, runId, step, parent, contributionsRoot, attestations);

        run.headStep = step;
        run.steps[step] = StepInfo({
            checkpoint: checkpoint,
            signersHash: bytes20(signersHash),
            committedAt: uint40(block.timestamp),
            epoch: run.epoch,
            openChallenges: 0,
            rejected: false
        });
        emit StepCommitted(runId, step, checkpoint, parent, contributionsRoot, metricsDigest, msg.sender);
        for (uint256 i = 0; i < attestations.length; ++i) {
            _emitContributionAttested(runId, step, signers[i], attestations[i]);
        }
    }

    /// @inheritdoc ITrainingLedger
    function finalize(uint256 runId, uint64 step) external {
        Run storage run = _existingRun(runId);
        _checkOnChain(run, runId, step);
        uint64 finalized = run.finalizedStep;
        if (step <= finalized) revert LedgerStepFinalized(runId, step);
        if (step != finalized + 1) revert LedgerParentNotFinal(runId, step);
        StepInfo storage record = run.steps[step];
        if (record.openChallenges != 0) revert LedgerStepChallenged(runId, step, record.openChallenges);
        uint64 deadline = record.committedAt + run.challengeWindow;
        // slither-disable-next-line timestamp -- windows are minutes to days; block times move by seconds.
        if (block.timestamp <= deadline) revert LedgerWindowOpen(runId, step, deadline);

        run.finalizedStep = step;
        emit StepFinalized(runId, step, record.checkpoint);
    }

    // ------------------------------------------------------------------------ slashing

    /// @inheritdoc ITrainingLedger
    function reportEquivocation(
        uint256 runId,
        uint64 step,
        bytes32 parent,
        Attestation calldata a,
        Attestation calldata b
    ) external returns (uint256 slashed) {
        Run storage run = _existingRun(runId);
        if (a.replica != b.replica || a.stage != b.stage) {
            revert LedgerDifferentSlots(a.replica, a.stage, b.replica, b.stage);
        }
        if (a.contribution == b.contribution) revert LedgerSameContribution(a.contribution);
        address node = _attestationSigner(runId, step, parent, a);
        address other = _attestationSigner(runId, step, parent, b);
        if (node != other) revert LedgerSignerMismatch(node, other);
        if (!run.members[node]) revert LedgerNotMember(runId, node);
        bytes32 offence = offenceId(_EQUIVOCATION, runId, step, a.replica, a.stage, parent, node);
        if (_slashed[offence]) revert LedgerAlreadySlashed(offence, node);

        _slashed[offence] = true;
        emit EquivocationSlashed(
            runId, step, node, a.replica, a.stage, parent, a.contribution, b.contribution, msg.sender
        );
        // slither-disable-next-line unused-return -- the reporter's reward is in the registry's Slashed event.
        (slashed,) = _registry.slash(node, msg.sender);
    }

    /// @inheritdoc ITrainingLedger
    function openChallenge(
        uint256 runId,
        uint64 step,
        uint32 replica,
        uint32 stage,
        address[] calldata signers,
        bytes32 evidence
    ) external payable returns (uint256 challengeId) {
        Run storage run = _existingRun(runId);
        if (run.quorum == 0) revert LedgerNoArbiters(runId);
        StepInfo storage record = _challengeableStep(run, runId, step);
        address node = _slotSigner(run, runId, record, replica, stage, signers);
        uint256 required = _required(run.minStake);
        uint256 staked = _registry.stakeOf(msg.sender);
        if (staked < required) revert LedgerInsufficientStake(msg.sender, staked, required);
        if (msg.value < required) revert LedgerInsufficientBond(required, msg.value);

        challengeId = ++_challengeCount;
        _challenges[challengeId] = Challenge({
            runId: runId,
            step: step,
            epoch: record.epoch,
            replica: replica,
            stage: stage,
            resolved: false,
            openedAt: uint40(block.timestamp),
            node: node,
            challenger: msg.sender,
            bond: msg.value
        });
        record.openChallenges += 1;
        _emitChallengeOpened(challengeId, evidence);
        _registry.holdBond{value: msg.value}(node);
    }

    /// @inheritdoc ITrainingLedger
    function resolveChallenge(uint256 challengeId, bool upheld, bytes[] calldata signatures) external {
        Challenge storage c = _existingChallenge(challengeId);
        if (c.resolved) revert LedgerChallengeResolved(challengeId);
        uint256 runId = c.runId;
        Run storage run = _runs[runId];
        _checkQuorum(run, runId, _verdictDigest(challengeId, upheld), signatures);

        c.resolved = true;
        StepInfo storage record = run.steps[c.step];
        // The record is still the one challenged unless a rollback below it was followed by
        // a new commit of the same step number (which bumped the epoch).
        bool current = record.epoch == c.epoch;
        if (current) record.openChallenges -= 1;
        bool slash = false;
        if (upheld) {
            bytes32 offence =
                offenceId(_FAILED_REPLAY, runId, c.step, c.replica, c.stage, bytes32(uint256(c.epoch)), c.node);
            if (!_slashed[offence]) {
                _slashed[offence] = true;
                slash = true;
            }
            if (current && !record.rejected) _rollback(run, runId, c.step, challengeId);
        }
        emit ChallengeResolved(challengeId, runId, c.step, c.node, upheld, slash);

        address node = c.node;
        address payee = upheld ? c.challenger : _registry.operatorOf(node);
        // slither-disable-next-line unused-return -- the amounts are in the registry's Slashed event.
        if (slash) _registry.slash(node, c.challenger);
        _registry.releaseBond(node, payee, c.bond);
    }

    /// @inheritdoc ITrainingLedger
    function expireChallenge(uint256 challengeId) external {
        Challenge storage c = _existingChallenge(challengeId);
        if (c.resolved) revert LedgerChallengeResolved(challengeId);
        uint256 deadline = uint256(c.openedAt) + _resolutionPeriod;
        // slither-disable-next-line timestamp -- the period is days; block times move by seconds.
        if (block.timestamp <= deadline) revert LedgerResolutionPending(challengeId, deadline);

        c.resolved = true;
        StepInfo storage record = _runs[c.runId].steps[c.step];
        if (record.epoch == c.epoch) record.openChallenges -= 1;
        emit ChallengeExpired(challengeId, c.runId, c.step, c.node);
        _registry.releaseBond(c.node, c.challenger, c.bond);
    }

    // ------------------------------------------------------------------------ views

    /// @inheritdoc ITrainingLedger
    function registry() external view returns (address) {
        return address(_registry);
    }

    /// @inheritdoc ITrainingLedger
    function maxChallengeWindow() external view returns (uint64) {
        return _maxChallengeWindow;
    }

    /// @inheritdoc ITrainingLedger
    function resolutionPeriod() external view returns (uint64) {
        return _resolutionPeriod;
    }

    /// @inheritdoc ITrainingLedger
    function runCount() external view returns (uint256) {
        return _runCount;
    }

    /// @inheritdoc ITrainingLedger
    function runHead(uint256 runId) external view returns (bytes32 head, uint64 step) {
        Run storage run = _existingRun(runId);
        step = run.headStep;
        head = run.steps[step].checkpoint;
    }

    /// @inheritdoc ITrainingLedger
    function stepCheckpoint(uint256 runId, uint64 step) external view returns (bytes32) {
        Run storage run = _existingRun(runId);
        return step > run.headStep ? bytes32(0) : run.steps[step].checkpoint;
    }

    /// @inheritdoc ITrainingLedger
    function stepInfo(uint256 runId, uint64 step) external view returns (StepInfo memory) {
        return _existingRun(runId).steps[step];
    }

    /// @inheritdoc ITrainingLedger
    function finalizedStep(uint256 runId) external view returns (uint64) {
        return _existingRun(runId).finalizedStep;
    }

    /// @inheritdoc ITrainingLedger
    function challengeWindowOf(uint256 runId) external view returns (uint64) {
        return _existingRun(runId).challengeWindow;
    }

    /// @inheritdoc ITrainingLedger
    function arbitersOf(uint256 runId) external view returns (address[] memory arbiters, uint32 quorum) {
        Run storage run = _existingRun(runId);
        return (run.arbiters, run.quorum);
    }

    /// @inheritdoc ITrainingLedger
    function challenge(uint256 challengeId) external view returns (Challenge memory) {
        return _existingChallenge(challengeId);
    }

    /// @inheritdoc ITrainingLedger
    function challengeCount() external view returns (uint256) {
        return _challengeCount;
    }

    /// @inheritdoc ITrainingLedger
    function isSlashed(bytes32 offence) external view returns (bool) {
        return _slashed[offence];
    }

    /// @inheritdoc ITrainingLedger
    function isMember(uint256 runId, address node) external view returns (bool) {
        return _runs[runId].members[node];
    }

    /// @inheritdoc ITrainingLedger
    function verdictDigest(uint256 challengeId, bool upheld) external view returns (bytes32) {
        return _verdictDigest(challengeId, upheld);
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
        Contribution memory message = Contribution({
            runId: runId,
            step: step,
            replica: replica,
            stage: stage,
            parent: parent,
            contribution: contribution,
            dataShard: dataShard,
            codeHash: codeHash,
            lossMicros: lossMicros
        });
        return _hashTypedDataV4(keccak256(abi.encode(CONTRIBUTION_TYPEHASH, message)));
    }

    /// @inheritdoc ITrainingLedger
    function offenceId(uint8 kind, uint256 runId, uint64 step, uint32 replica, uint32 stage, bytes32 key, address node)
        public
        pure
        returns (bytes32)
    {
        return keccak256(abi.encode(kind, runId, step, replica, stage, key, node));
    }

    // ------------------------------------------------------------------------ internals

    /// @dev Writes a new run's parameters, with `genesisDigest` as its head at step 0.
    function _storeRun(
        Run storage run,
        bytes32 configDigest,
        bytes32 genesisDigest,
        uint32 replicas,
        uint32 stages,
        uint64 challengeWindow_,
        uint256 minStake,
        uint32 quorum
    ) private {
        run.creator = msg.sender;
        run.replicas = replicas;
        run.stages = stages;
        run.quorum = quorum;
        run.challengeWindow = challengeWindow_;
        run.configDigest = configDigest;
        run.minStake = minStake;
        run.steps[0].checkpoint = genesisDigest;
        run.steps[0].committedAt = uint40(block.timestamp);
    }

    /// @dev Makes each of `nodes` a member of `run`; reverts with {LedgerDuplicateNode} on a
    /// repeated node (the revert undoes the memberships already written).
    function _addMembers(Run storage run, address[] calldata nodes) private {
        for (uint256 i = 0; i < nodes.length; ++i) {
            if (run.members[nodes[i]]) revert LedgerDuplicateNode(nodes[i]);
            run.members[nodes[i]] = true;
        }
    }

    /// @dev Stores `arbiters` in `run`; reverts with {LedgerInvalidArbiter} on a repeated
    /// or zero address.
    function _addArbiters(Run storage run, address[] calldata arbiters) private {
        for (uint256 i = 0; i < arbiters.length; ++i) {
            address arbiter = arbiters[i];
            if (arbiter == address(0) || run.isArbiter[arbiter]) revert LedgerInvalidArbiter(arbiter);
            run.isArbiter[arbiter] = true;
        }
        run.arbiters = arbiters;
    }

    /// @dev Emits {RunCreated} from the stored run: createRun has too many parameters to
    /// emit it from its own stack frame without via-ir.
    function _emitRunCreated(uint256 runId, address[] calldata nodes) private {
        Run storage run = _runs[runId];
        emit RunCreated(runId, run.creator, run.configDigest, run.steps[0].checkpoint, run.replicas, run.stages, nodes);
    }

    /// @dev Emits {ChallengeOpened} from the stored challenge (openChallenge's own frame has
    /// no stack slots left for it without via-ir).
    function _emitChallengeOpened(uint256 challengeId, bytes32 evidence) private {
        Challenge storage c = _challenges[challengeId];
        emit ChallengeOpened(
            challengeId, c.runId, c.step, c.node, c.epoch, c.replica, c.stage, c.challenger, c.bond, evidence
        );
    }

    /// @dev Emits {ContributionAttested} for `a`, signed by `node`. Its six data fields are
    /// `Attestation`'s first six, so they are copied from calldata into scratch memory in one
    /// go: commitStep emits one per slot, and Solidity's encoder would allocate fresh memory
    /// each time. _verifyAttestations has validated every copied field.
    // slither-disable-next-line assembly -- scratch-memory copy; see the comment above.
    function _emitContributionAttested(uint256 runId, uint64 step, address node, Attestation calldata a) private {
        bytes32 topic = ContributionAttested.selector;
        assembly ("memory-safe") {
            let m := mload(0x40)
            calldatacopy(m, a, 0xc0)
            log4(m, 0xc0, topic, runId, step, node)
        }
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
    ) private returns (address[] memory signers, bytes32 signersHash) {
        uint32 stages = run.stages;
        uint256 slots = uint256(run.replicas) * stages;
        if (attestations.length != slots) revert LedgerWrongAttestationCount(slots, attestations.length);

        signers = new address[](slots);
        bytes32[] memory contributions = new bytes32[](slots);
        for (uint256 i = 0; i < slots; ++i) {
            Attestation calldata a = attestations[i];
            // replica * stages + stage == i with stage < stages pins replica < replicas too.
            // Reading lossMicros validates it (an int64 must be sign-extended in calldata).
            if (a.stage >= stages || uint256(a.replica) * stages + a.stage != i || a.lossMicros != a.lossMicros) {
                revert LedgerSlotOutOfOrder(i, a.replica, a.stage);
            }
            signers[i] = _attestationSigner(runId, step, parent, a);
            contributions[i] = a.contribution;
        }
        signersHash = keccak256(abi.encodePacked(signers));
        _checkEligible(run, runId, signers, signersHash);

        // abi.encodePacked of a bytes32[] is its elements back to back, without a length.
        bytes32 expectedRoot = keccak256(abi.encodePacked(contributions));
        if (contributionsRoot != expectedRoot) revert LedgerContributionsRootMismatch(expectedRoot, contributionsRoot);
    }

    /// @dev Reverts unless every one of `signers` is a member of `run` with an active stake of
    /// at least the run's minimum (and above zero).
    ///
    /// The check is cached per run: a run's membership and minimum never change, and a node's
    /// active stake only ever drops through {INodeRegistry-unbond} or a slash, each of which
    /// bumps the registry's {INodeRegistry-stakeDecreases} counter. So when this step's signer
    /// list is the one last checked and the counter has not moved since, every signer is
    /// still eligible, and the per-signer reads (a membership slot here and a stake slot in
    /// the registry, both cold) are skipped. Steady runs sign with the same nodes every step.
    function _checkEligible(Run storage run, uint256 runId, address[] memory signers, bytes32 signersHash) private {
        uint64 decreases = _registry.stakeDecreases();
        EligibleSigners storage cache = run.eligible;
        if (cache.signers == bytes24(signersHash) && cache.atDecreases == decreases) return;

        for (uint256 i = 0; i < signers.length; ++i) {
            if (!run.members[signers[i]]) revert LedgerNotMember(runId, signers[i]);
        }
        // One call for all stakes: a call per signer would cost more than the reads.
        uint256 required = _required(run.minStake);
        uint256[] memory stakes = _registry.stakesOf(signers);
        for (uint256 i = 0; i < signers.length; ++i) {
            if (stakes[i] < required) revert LedgerInsufficientStake(signers[i], stakes[i], required);
        }
        cache.signers = bytes24(signersHash);
        cache.atDecreases = decreases;
    }

    /// @dev The record of `step` if it can be challenged now; reverts with the reason if not.
    function _challengeableStep(Run storage run, uint256 runId, uint64 step)
        private
        view
        returns (StepInfo storage record)
    {
        _checkOnChain(run, runId, step);
        if (step <= run.finalizedStep) revert LedgerStepFinalized(runId, step);
        record = run.steps[step];
        uint64 deadline = record.committedAt + run.challengeWindow;
        // slither-disable-next-line timestamp -- windows are minutes to days; block times move by seconds.
        if (block.timestamp > deadline) revert LedgerWindowClosed(runId, step, deadline);
    }

    /// @dev Reverts unless `step` is at or below the head (rejected steps lie above it).
    function _checkOnChain(Run storage run, uint256 runId, uint64 step) private view {
        if (step > run.headStep) {
            if (run.steps[step].rejected) revert LedgerStepRejected(runId, step);
            revert LedgerUnknownStep(runId, step);
        }
    }

    /// @dev The node that attested slot (`replica`, `stage`) of `record`, given the record's
    /// signers in slot order.
    function _slotSigner(
        Run storage run,
        uint256 runId,
        StepInfo storage record,
        uint32 replica,
        uint32 stage,
        address[] calldata signers
    ) private view returns (address) {
        uint32 stages = run.stages;
        if (replica >= run.replicas || stage >= stages) revert LedgerSlotOutOfRange(runId, replica, stage);
        bytes20 got = bytes20(keccak256(abi.encodePacked(signers)));
        if (got != record.signersHash) revert LedgerSignersMismatch(record.signersHash, got);
        // A matching hash means `signers` has exactly replicas * stages entries.
        return signers[uint256(replica) * stages + stage];
    }

    /// @dev Reverts unless `signatures` are at least the run's quorum of distinct arbiters'
    /// signatures over `digest`, sorted by ascending signer.
    function _checkQuorum(Run storage run, uint256 runId, bytes32 digest, bytes[] calldata signatures) private view {
        uint256 quorum = run.quorum;
        if (signatures.length < quorum) revert LedgerQuorumNotReached(signatures.length, quorum);
        address previous = address(0);
        for (uint256 i = 0; i < signatures.length; ++i) {
            address signer = ECDSA.recover(digest, signatures[i]);
            if (!run.isArbiter[signer]) revert LedgerNotArbiter(runId, signer);
            if (signer <= previous) revert LedgerVerdictsNotSorted(i, signer);
            previous = signer;
        }
    }

    /// @dev Rejects `step` and every step above it up to the head, and makes `step - 1` the
    /// head. `step` is above the final step, so no final step is touched. The loop is
    /// bounded by the steps committed within one challenge window.
    function _rollback(Run storage run, uint256 runId, uint64 step, uint256 challengeId) private {
        uint64 headStep = run.headStep;
        for (uint64 s = step; s <= headStep; ++s) {
            StepInfo storage record = run.steps[s];
            record.rejected = true;
            emit StepRejected(runId, s, record.checkpoint, challengeId);
        }
        run.headStep = step - 1;
        run.epoch += 1;
        emit HeadRolledBack(runId, headStep, step - 1, run.steps[step - 1].checkpoint);
    }

    /// @dev The key that signed `a` for step `step` of run `runId` on top of `parent`.
    /// Reverts with OpenZeppelin's ECDSA errors on a malformed signature.
    function _attestationSigner(uint256 runId, uint64 step, bytes32 parent, Attestation calldata a)
        private
        view
        returns (address)
    {
        return ECDSA.recoverCalldata(_hashTypedDataV4(_contributionHash(runId, step, parent, a)), a.signature);
    }

    /// @dev The EIP-712 `hashStruct` of the `Contribution` that `a` attests, built in scratch
    /// memory past the free memory pointer: commitStep hashes one per slot, and allocating a
    /// struct and its encoding each time would grow memory with every attestation.
    /// `Attestation`'s first six fields are static, in `Contribution` order around `parent`:
    /// replica and stage at offsets 0x00 and 0x20; contribution, dataShard, codeHash and
    /// lossMicros from 0x40 to 0xbf. Callers validate the fields they read (commitStep reads
    /// them all), and a dirty word only hashes to a message nobody signed.
    // slither-disable-next-line assembly -- scratch-memory hashing; see the comment above.
    function _contributionHash(uint256 runId, uint64 step, bytes32 parent, Attestation calldata a)
        private
        pure
        returns (bytes32 structHash)
    {
        bytes32 typehash = CONTRIBUTION_TYPEHASH;
        assembly ("memory-safe") {
            let m := mload(0x40)
            mstore(m, typehash)
            mstore(add(m, 0x20), runId)
            mstore(add(m, 0x40), step)
            calldatacopy(add(m, 0x60), a, 0x40)
            mstore(add(m, 0xa0), parent)
            calldatacopy(add(m, 0xc0), add(a, 0x40), 0x80)
            structHash := keccak256(m, 0x140)
        }
    }

    /// @dev The EIP-712 digest of `Verdict(challengeId, upheld)` in this ledger's domain.
    function _verdictDigest(uint256 challengeId, bool upheld) private view returns (bytes32) {
        return _hashTypedDataV4(keccak256(abi.encode(VERDICT_TYPEHASH, challengeId, upheld)));
    }

    /// @dev The least stake (or bond) that counts: the run's minimum, and never zero.
    function _required(uint256 minStake) private pure returns (uint256) {
        return minStake == 0 ? 1 : minStake;
    }

    /// @dev The run with id `runId`; reverts with {LedgerUnknownRun} if there is none.
    function _existingRun(uint256 runId) private view returns (Run storage run) {
        if (runId == 0 || runId > _runCount) revert LedgerUnknownRun(runId);
        return _runs[runId];
    }

    /// @dev The challenge with id `challengeId`; reverts with {LedgerUnknownChallenge}.
    function _existingChallenge(uint256 challengeId) private view returns (Challenge storage) {
        if (challengeId == 0 || challengeId > _challengeCount) revert LedgerUnknownChallenge(challengeId);
        return _challenges[challengeId];
    }
}
