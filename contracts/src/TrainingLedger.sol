// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";
import {EIP712} from "@openzeppelin/contracts/utils/cryptography/EIP712.sol";

import {INodeRegistry} from "./interfaces/INodeRegistry.sol";
import {ITrainingLedger} from "./interfaces/ITrainingLedger.sol";

/// @title TrainingLedger
/// @notice Records the outer steps of DiLoCoX training runs as a chain of checkpoints, each
/// backed by one EIP-712 attestation per (replica, stage) slot of the replicas present in the
/// step (its replica set, at least the run's `minReplicas`) from a staked member node;
/// slashes equivocating nodes on proof, lets staked verifiers challenge a step's replay
/// before an arbiter quorum, rolls the head back past rejected steps, and finalizes steps
/// whose challenge window passed.
/// @dev Signing domain: {name: "DiLoCoXLedger", version: "3", chainId, verifyingContract}
/// (ERC-5267 `eip712Domain()` tells a verifier which version a deployment speaks; version 2
/// signed no `replicaSet` and every step had all replicas; version 1 also signed no
/// `newShard` and took 65-byte signatures). Each attestation is signed over its step's
/// replica set and co-signs the new shard of its stage, the present replicas of a stage must
/// agree on it, and within a step a node (or an operator, as the run chose) signs the slots
/// of at most one replica.
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
        "Contribution(uint256 runId,uint64 step,uint32 replica,uint32 stage,uint256 replicaSet,bytes32 parent,bytes32 contribution,bytes32 dataShard,bytes32 codeHash,int64 lossMicros,bytes32 newShard)"
    );

    /// @inheritdoc ITrainingLedger
    bytes32 public constant VERDICT_TYPEHASH = keccak256("Verdict(uint256 challengeId,bool upheld)");

    /// @dev The EIP-712 type hash of an approved run's admission, signed by the run's creator.
    bytes32 private constant _ADMISSION_TYPEHASH = keccak256("Admission(uint256 runId,address node,uint64 expiry)");

    /// @dev A node's membership of a run: none; named at creation; joined ({joinRun}, its
    /// stake locked); left ({leaveRun}: it signs no more, but stays answerable for what it signed).
    uint8 private constant _NONE = 0;
    uint8 private constant _FOUNDER = 1;
    uint8 private constant _JOINED = 2;
    uint8 private constant _LEFT = 3;

    uint8 private constant _EQUIVOCATION = 0;
    uint8 private constant _FAILED_REPLAY = 1;
    uint8 private constant _BAD_AGGREGATE = 2;
    uint8 private constant _RESULT_EQUIVOCATION = 3;
    /// @dev A step's replica set is a uint256 bitmap: bit r is replica r.
    uint32 private constant _MAX_REPLICAS = 256;

    /// @dev The signer list whose eligibility was last checked in full for a run (the first
    /// 24 bytes of its hash, collision-resistant to 2^96 work), and the registry's
    /// {INodeRegistry-stakeDecreases} at that moment; one slot. See {_checkEligible}.
    struct EligibleSigners {
        bytes24 signers;
        uint64 atDecreases;
    }

    /// @dev One training run. `creator`, the shape and `quorum` share a slot; so do the
    /// head, the window, the final step, the epoch, the independence mode and `minReplicas`
    /// (commitStep reads that slot anyway; at most 256 replicas fit a uint16). The head
    /// checkpoint is `steps[headStep].checkpoint`.
    struct Run {
        address creator;
        uint32 replicas;
        uint32 stages;
        uint32 quorum;
        uint64 headStep;
        uint64 challengeWindow;
        uint64 finalizedStep;
        uint32 epoch;
        Independence independence;
        uint16 minReplicas;
        bool ended;
        bytes32 configDigest;
        uint256 minStake;
        address[] arbiters;
        EligibleSigners eligible;
        Admission admission;
        uint64 endedAt;
        uint128 rewardPerStep;
        mapping(address node => uint8) members;
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
    mapping(uint256 challengeId => address[]) private _coSigners;

    /// @param registry_ The registry whose stakes back attestations; it must bind this
    /// ledger ({INodeRegistry-bindLedger}) before slashing and challenges work.
    constructor(INodeRegistry registry_) EIP712("DiLoCoXLedger", "3") {
        _registry = registry_;
        // Every window stays strictly below the unbonding delay (see NodeRegistry).
        _maxChallengeWindow = registry_.unbondingDelay() - 1;
        _resolutionPeriod = registry_.unbondingDelay();
    }

    // ------------------------------------------------------------------------ runs and steps

    /// @inheritdoc ITrainingLedger
    function commitStep(
        uint256 runId,
        uint64 step,
        bytes32 parent,
        bytes32 checkpoint,
        bytes32 contributionsRoot,
        bytes32 metricsDigest,
        uint256 replicaSet,
        Attestation[] calldata attestations
    ) external {
        Run storage run = _existingRun(runId);
        if (run.ended) revert LedgerRunEnded(runId);
        {
            uint64 headStep = run.headStep;
            if (step != headStep + 1) revert LedgerWrongStep(headStep + 1, step);
            bytes32 head = run.steps[headStep].checkpoint;
            if (parent != head) revert LedgerStaleParent(head, parent);
        }
        if (checkpoint == bytes32(0)) revert LedgerZeroDigest();
        (address[] memory signers, bytes32 signersHash, bytes32 shardsRoot) =
            _verifyAttestations(run, runId, step, parent, contributionsRoot, replicaSet, attestations);

        run.headStep = step;
        run.steps[step] = StepInfo({
            checkpoint: checkpoint,
            witnessHash: _witnessHash(signersHash, shardsRoot, replicaSet),
            committedAt: uint40(block.timestamp),
            epoch: run.epoch,
            openChallenges: 0,
            rejected: false
        });
        emit StepCommitted(
            runId, step, checkpoint, parent, contributionsRoot, metricsDigest, msg.sender, shardsRoot, replicaSet
        );
        for (uint256 i = 0; i < attestations.length; ++i) {
            _emitContributionAttested(runId, step, signers[i], attestations[i]);
        }
    }

    /// @inheritdoc ITrainingLedger
    function finalize(uint256 runId, uint64 step) external {
        Run storage run = _existingRun(runId);
        if (run.rewardPerStep != 0) revert LedgerRewardNeedsWitnesses(runId);
        _finalizeNext(run, runId, step);
    }

    /// @inheritdoc ITrainingLedger
    // slither-disable-next-line reentrancy-events -- the registry is this ledger's own, fixed at deployment; a step's events follow its payment.
    function finalizeSteps(uint256 runId, StepWitness[] calldata witnesses) external returns (uint64 finalized) {
        Run storage run = _existingRun(runId);
        finalized = run.finalizedStep;
        for (uint256 i = 0; i < witnesses.length; ++i) {
            StepWitness calldata w = witnesses[i];
            StepInfo storage record = _finalizeNext(run, runId, ++finalized);
            _checkWitnesses(record, w.signers, w.shardsRoot, w.replicaSet);
            uint256 reward = run.rewardPerStep;
            // slither-disable-next-line unused-return,calls-loop -- the registry's StepRewarded event has the amounts; the registry is fixed at deployment.
            if (reward != 0) _registry.payStep(runId, finalized, w.signers, reward, record.committedAt);
        }
    }

    // ------------------------------------------------------------------------ membership and pools

    /// @inheritdoc ITrainingLedger
    function createRun(RunSpec calldata spec) external payable returns (uint256 runId) {
        _checkShape(spec.replicas, spec.stages, spec.minReplicas, spec.independence, spec.challengeWindow);
        if (spec.admission > uint8(type(Admission).max)) revert LedgerInvalidAdmission(spec.admission);
        if (spec.nodes.length == 0 && spec.admission == uint8(Admission.Closed)) revert LedgerNoNodes();
        if (spec.quorum > spec.arbiters.length || (spec.quorum == 0 && spec.arbiters.length != 0)) {
            revert LedgerInvalidQuorum(spec.quorum, spec.arbiters.length);
        }
        if (spec.genesisDigest == bytes32(0)) revert LedgerZeroDigest();

        runId = _storeRun(spec.configDigest, spec.genesisDigest, spec.challengeWindow, spec.minStake);
        Run storage run = _runs[runId];
        run.replicas = spec.replicas;
        run.stages = spec.stages;
        run.quorum = spec.quorum;
        // casting to 'uint16' is safe because minReplicas <= replicas <= 256
        // forge-lint: disable-next-line(unsafe-typecast)
        run.minReplicas = uint16(spec.minReplicas);
        run.independence = Independence(spec.independence);
        run.admission = Admission(spec.admission);
        run.rewardPerStep = spec.rewardPerStep;
        _addMembers(run, spec.nodes);
        _addArbiters(run, spec.arbiters);
        _emitRunCreated(runId, spec.nodes);
        emit RunTermsSet(runId, run.admission, spec.rewardPerStep);
        if (msg.value != 0) _registry.fundPool{value: msg.value}(runId, msg.sender);
    }

    /// @inheritdoc ITrainingLedger
    function joinRun(uint256 runId, uint64 expiry, bytes calldata admission) external {
        Run storage run = _existingRun(runId);
        if (run.ended) revert LedgerRunEnded(runId);
        Admission rule = run.admission;
        if (rule == Admission.Closed) revert LedgerRunClosed(runId);
        uint8 membership = run.members[msg.sender];
        if (membership == _FOUNDER || membership == _JOINED) revert LedgerAlreadyMember(runId, msg.sender);
        if (rule == Admission.Approved) _checkAdmission(run, runId, expiry, admission);

        run.members[msg.sender] = _JOINED;
        emit MemberJoined(runId, msg.sender, run.headStep + 1);
        _registry.lockStake(msg.sender, _required(run.minStake));
    }

    /// @inheritdoc ITrainingLedger
    function leaveRun(uint256 runId) external {
        Run storage run = _existingRun(runId);
        uint8 membership = run.members[msg.sender];
        if (membership != _FOUNDER && membership != _JOINED) revert LedgerNotMember(runId, msg.sender);

        run.members[msg.sender] = _LEFT;
        // The eligibility cache assumes members never leave: forget it.
        run.eligible.signers = bytes24(0);
        emit MemberLeft(runId, msg.sender, run.headStep);
        if (membership == _JOINED) _registry.unlockStake(msg.sender, _required(run.minStake));
    }

    /// @inheritdoc ITrainingLedger
    function fundRun(uint256 runId) external payable {
        _existingRun(runId);
        _registry.fundPool{value: msg.value}(runId, msg.sender);
    }

    /// @inheritdoc ITrainingLedger
    function endRun(uint256 runId) external {
        Run storage run = _existingRun(runId);
        if (msg.sender != run.creator) revert LedgerNotCreator(runId, msg.sender);
        if (run.ended) revert LedgerRunEnded(runId);
        run.ended = true;
        run.endedAt = uint64(block.timestamp);
        emit RunEnded(runId, uint64(block.timestamp));
    }

    /// @inheritdoc ITrainingLedger
    function withdrawPool(uint256 runId) external {
        Run storage run = _existingRun(runId);
        if (!run.ended) revert LedgerPoolLocked(runId, type(uint64).max);
        uint64 until = run.endedAt + _resolutionPeriod;
        // slither-disable-next-line timestamp -- the delay is days; block times move by seconds.
        if (block.timestamp < until) revert LedgerPoolLocked(runId, until);
        if (run.finalizedStep != run.headStep) revert LedgerStepsNotFinal(runId, run.finalizedStep, run.headStep);
        // slither-disable-next-line unused-return -- the registry's PoolWithdrawn event has the amount.
        _registry.withdrawPool(runId, msg.sender);
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
        if (a.replicaSet != b.replicaSet) revert LedgerDifferentReplicaSets(a.replicaSet, b.replicaSet);
        address node = _attestationSigner(runId, step, parent, a);
        address other = _attestationSigner(runId, step, parent, b);
        if (node != other) revert LedgerSignerMismatch(node, other);
        if (run.members[node] == _NONE) revert LedgerNotMember(runId, node);
        bytes32 offence = offenceId(_EQUIVOCATION, runId, step, a.replica, a.stage, parent, node);
        if (_slashed[offence]) revert LedgerAlreadySlashed(offence, node);

        _slashed[offence] = true;
        emit EquivocationSlashed(
            runId, step, node, a.replica, a.stage, parent, a.contribution, b.contribution, msg.sender
        );
        slashed = _slash(run, runId, node, msg.sender);
    }

    /// @inheritdoc ITrainingLedger
    function reportResultEquivocation(
        uint256 runId,
        uint64 step,
        bytes32 parent,
        Attestation calldata a,
        Attestation calldata b
    ) external returns (uint256 slashed) {
        Run storage run = _existingRun(runId);
        if (a.stage != b.stage) revert LedgerDifferentStages(a.stage, b.stage);
        if (a.newShard == b.newShard) revert LedgerSameShard(a.newShard);
        if (a.replicaSet != b.replicaSet) revert LedgerDifferentReplicaSets(a.replicaSet, b.replicaSet);
        address node = _attestationSigner(runId, step, parent, a);
        address other = _attestationSigner(runId, step, parent, b);
        if (node != other) revert LedgerSignerMismatch(node, other);
        if (run.members[node] == _NONE) revert LedgerNotMember(runId, node);
        // Any replica: one node co-signing two results for a stage is one offence.
        bytes32 offence = offenceId(_RESULT_EQUIVOCATION, runId, step, type(uint32).max, a.stage, parent, node);
        if (_slashed[offence]) revert LedgerAlreadySlashed(offence, node);

        _slashed[offence] = true;
        emit ResultEquivocationSlashed(runId, step, node, a.stage, parent, a.newShard, b.newShard, msg.sender);
        slashed = _slash(run, runId, node, msg.sender);
    }

    /// @inheritdoc ITrainingLedger
    function openChallenge(
        uint256 runId,
        uint64 step,
        uint32 replica,
        uint32 stage,
        uint256 replicaSet,
        address[] calldata signers,
        bytes32 shardsRoot,
        bytes32 evidence
    ) external payable returns (uint256 challengeId) {
        Run storage run = _existingRun(runId);
        if (run.quorum == 0) revert LedgerNoArbiters(runId);
        StepInfo storage record = _challengeableStep(run, runId, step);
        if (replica >= run.replicas || stage >= run.stages) revert LedgerSlotOutOfRange(runId, replica, stage);
        _checkWitnesses(record, signers, shardsRoot, replicaSet);
        address node = _slotSigner(signers, replicaSet, replica, stage, run.stages);
        challengeId = _storeChallenge(run, runId, step, replica, stage, node, false);
        _emitChallengeOpened(challengeId, evidence);
        _registry.holdBond{value: msg.value}(node);
    }

    /// @inheritdoc ITrainingLedger
    function openAggregateChallenge(
        uint256 runId,
        uint64 step,
        uint32 stage,
        uint256 replicaSet,
        address[] calldata signers,
        bytes32[] calldata shards,
        bytes32 evidence
    ) external payable returns (uint256 challengeId) {
        Run storage run = _existingRun(runId);
        if (run.quorum == 0) revert LedgerNoArbiters(runId);
        StepInfo storage record = _challengeableStep(run, runId, step);
        address[] memory coSigners = _coSignersAt(run, runId, record, stage, replicaSet, signers, shards);
        challengeId = _storeChallenge(run, runId, step, 0, stage, coSigners[0], true);
        _coSigners[challengeId] = coSigners;
        _emitChallengeOpened(challengeId, evidence);
        emit AggregateChallenged(challengeId, stage, shards[stage], coSigners);
        _registry.holdBond{value: msg.value}(coSigners[0]);
        for (uint256 r = 1; r < coSigners.length; ++r) {
            // slither-disable-next-line calls-loop -- the registry is this ledger's own, fixed at deployment.
            _registry.holdNode(coSigners[r]);
        }
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
        address[] memory nodes = _answering(c, challengeId);
        bool[] memory slash = new bool[](nodes.length);
        bool slashed = false;
        if (upheld) {
            slashed = _markOffences(c, nodes, slash);
            if (current && !record.rejected) _rollback(run, runId, c.step, challengeId);
        }
        emit ChallengeResolved(challengeId, runId, c.step, c.node, upheld, slashed);

        address payee = upheld ? c.challenger : _registry.operatorOf(c.node);
        for (uint256 i = 0; i < nodes.length; ++i) {
            // slither-disable-next-line unused-return -- amounts are in the registry's Slashed events.
            if (slash[i]) _slash(run, runId, nodes[i], c.challenger);
        }
        _release(c, nodes, payee);
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
        _release(c, _answering(c, challengeId), c.challenger);
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
    function coSignersOf(uint256 challengeId) external view returns (address[] memory) {
        _existingChallenge(challengeId);
        return _coSigners[challengeId];
    }

    /// @inheritdoc ITrainingLedger
    function independenceOf(uint256 runId) external view returns (Independence) {
        return _existingRun(runId).independence;
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
        uint8 membership = _runs[runId].members[node];
        return membership == _FOUNDER || membership == _JOINED;
    }

    /// @inheritdoc ITrainingLedger
    function runTerms(uint256 runId)
        external
        view
        returns (Admission admission, uint128 rewardPerStep, uint64 endedAt)
    {
        Run storage run = _existingRun(runId);
        return (run.admission, run.rewardPerStep, run.endedAt);
    }

    /// @inheritdoc ITrainingLedger
    function admissionDigest(uint256 runId, address node, uint64 expiry) public view returns (bytes32) {
        return _hashTypedDataV4(keccak256(abi.encode(_ADMISSION_TYPEHASH, runId, node, expiry)));
    }

    /// @inheritdoc ITrainingLedger
    function verdictDigest(uint256 challengeId, bool upheld) external view returns (bytes32) {
        return _verdictDigest(challengeId, upheld);
    }

    /// @inheritdoc ITrainingLedger
    function contributionDigest(uint256 runId, uint64 step, bytes32 parent, Attestation calldata a)
        external
        view
        returns (bytes32)
    {
        return _hashTypedDataV4(_contributionHash(runId, step, parent, a));
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

    /// @dev Stores a new run with its creator, digests, window and minimum stake, with
    /// `genesisDigest` as its head at step 0; returns its id. createRun writes the rest: its
    /// own frame has no stack slots left to pass it all on without via-ir.
    function _storeRun(bytes32 configDigest, bytes32 genesisDigest, uint64 challengeWindow_, uint256 minStake)
        private
        returns (uint256 runId)
    {
        runId = ++_runCount;
        Run storage run = _runs[runId];
        run.creator = msg.sender;
        run.challengeWindow = challengeWindow_;
        run.configDigest = configDigest;
        run.minStake = minStake;
        run.steps[0].checkpoint = genesisDigest;
        run.steps[0].committedAt = uint40(block.timestamp);
    }

    /// @dev Reverts unless a run's shape, independence mode and challenge window are valid.
    function _checkShape(uint32 replicas, uint32 stages, uint32 minReplicas, uint8 independence, uint64 window)
        private
        view
    {
        if (replicas == 0 || replicas > _MAX_REPLICAS || stages == 0) revert LedgerInvalidShape(replicas, stages);
        if (minReplicas == 0 || minReplicas > replicas) revert LedgerInvalidMinReplicas(minReplicas, replicas);
        if (independence > uint8(type(Independence).max)) revert LedgerInvalidIndependence(independence);
        if (window > _maxChallengeWindow) revert LedgerWindowTooLong(window, _maxChallengeWindow);
    }

    /// @dev Makes `step` of `run` final if it is the next one due; returns its record.
    function _finalizeNext(Run storage run, uint256 runId, uint64 step) private returns (StepInfo storage record) {
        _checkOnChain(run, runId, step);
        uint64 finalized = run.finalizedStep;
        if (step <= finalized) revert LedgerStepFinalized(runId, step);
        if (step != finalized + 1) revert LedgerParentNotFinal(runId, step);
        record = run.steps[step];
        if (record.openChallenges != 0) revert LedgerStepChallenged(runId, step, record.openChallenges);
        uint64 deadline = record.committedAt + run.challengeWindow;
        // slither-disable-next-line timestamp -- windows are minutes to days; block times move by seconds.
        if (block.timestamp <= deadline) revert LedgerWindowOpen(runId, step, deadline);

        run.finalizedStep = step;
        emit StepFinalized(runId, step, record.checkpoint);
    }

    /// @dev Slashes `node` for an offence in `run`, crediting `reporter` its share; the rest
    /// joins the run's pool as its creator's funding (so a pool nobody funded can still be
    /// withdrawn). Returns the wei slashed.
    function _slash(Run storage run, uint256 runId, address node, address reporter) private returns (uint256 amount) {
        // slither-disable-next-line unused-return,calls-loop -- the reward is in the registry's Slashed event; the registry is fixed at deployment.
        (amount,) = _registry.slash(node, reporter, runId, run.creator);
    }

    /// @dev Reverts unless `admission` is the creator's signature over
    /// `Admission(runId, msg.sender, expiry)` and `expiry` has not passed.
    function _checkAdmission(Run storage run, uint256 runId, uint64 expiry, bytes calldata admission) private view {
        if (admission.length == 0) revert LedgerAdmissionRequired(runId);
        // slither-disable-next-line timestamp -- admissions last hours to days; block times move by seconds.
        if (block.timestamp > expiry) revert LedgerAdmissionExpired(runId, expiry);
        address signer = ECDSA.recover(admissionDigest(runId, msg.sender, expiry), admission);
        if (signer != run.creator) revert LedgerAdmissionNotByCreator(runId, run.creator, signer);
    }

    /// @dev Makes each of `nodes` a member of `run`; reverts with {LedgerDuplicateNode} on a
    /// repeated node (the revert undoes the memberships already written).
    function _addMembers(Run storage run, address[] calldata nodes) private {
        for (uint256 i = 0; i < nodes.length; ++i) {
            if (run.members[nodes[i]] != _NONE) revert LedgerDuplicateNode(nodes[i]);
            run.members[nodes[i]] = _FOUNDER;
        }
    }

    /// @dev Stores `arbiters` in `run`; reverts with {LedgerInvalidArbiter} on a repeated
    /// or zero address.
    function _addArbiters(Run storage run, address[] memory arbiters) private {
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
        emit RunCreated(
            runId,
            run.creator,
            run.configDigest,
            run.steps[0].checkpoint,
            run.replicas,
            run.stages,
            run.minReplicas,
            nodes,
            run.independence
        );
    }

    /// @dev Emits {ChallengeOpened} from the stored challenge (openChallenge's own frame has
    /// no stack slots left for it without via-ir).
    function _emitChallengeOpened(uint256 challengeId, bytes32 evidence) private {
        Challenge storage c = _challenges[challengeId];
        emit ChallengeOpened(
            challengeId, c.runId, c.step, c.node, c.epoch, c.replica, c.stage, c.challenger, c.bond, evidence
        );
    }

    /// @dev Emits {ContributionAttested} for `a`, signed by `node`. Its seven data fields are
    /// `Attestation`'s first eight but `replicaSet` (which {StepCommitted} carries once), so
    /// they are copied from calldata into scratch memory in two pieces: commitStep emits one
    /// per slot, and Solidity's encoder would allocate fresh memory each time.
    /// _verifyAttestations has validated every copied field.
    // slither-disable-next-line assembly -- scratch-memory copy; see the comment above.
    function _emitContributionAttested(uint256 runId, uint64 step, address node, Attestation calldata a) private {
        bytes32 topic = ContributionAttested.selector;
        assembly ("memory-safe") {
            let m := mload(0x40)
            calldatacopy(m, a, 0x40)
            calldatacopy(add(m, 0x40), add(a, 0x60), 0xa0)
            log4(m, 0xe0, topic, runId, step, node)
        }
    }

    /// @dev Checks the replica set and the attestations against the run and
    /// `contributionsRoot`; returns the signer of each in slot order, their hash, and the
    /// root of the co-signed stage shards.
    function _verifyAttestations(
        Run storage run,
        uint256 runId,
        uint64 step,
        bytes32 parent,
        bytes32 contributionsRoot,
        uint256 replicaSet,
        Attestation[] calldata attestations
    ) private returns (address[] memory signers, bytes32 signersHash, bytes32 shardsRoot) {
        uint32 stages = run.stages;
        uint256 slots = _checkReplicaSet(run, replicaSet) * stages;
        if (attestations.length > slots) revert LedgerWrongAttestationCount(slots, attestations.length);
        bytes32[] memory contributions;
        bytes32[] memory shards;
        (signers, contributions, shards) = _readSlots(runId, step, parent, replicaSet, stages, attestations);
        if (attestations.length < slots) {
            // The first slot past the last attestation is missing.
            uint32 replica = _replicaAt(replicaSet, attestations.length / stages);
            // casting to 'uint32' is safe because it is below the run's uint32 stages
            // forge-lint: disable-next-line(unsafe-typecast)
            revert LedgerMissingStage(replica, uint32(attestations.length % stages));
        }
        signersHash = keccak256(abi.encodePacked(signers));
        _checkEligible(run, runId, signers, signersHash, replicaSet);

        // abi.encodePacked of a bytes32[] is its elements back to back, without a length.
        bytes32 expectedRoot = keccak256(abi.encodePacked(contributions));
        if (contributionsRoot != expectedRoot) revert LedgerContributionsRootMismatch(expectedRoot, contributionsRoot);
        shardsRoot = keccak256(abi.encodePacked(shards));
    }

    /// @dev Walks the attestations of a step over `replicaSet` (at most one per slot, which
    /// the caller checked) in slot order; returns each one's signer and contribution, and
    /// the stage shards the set's first replica co-signed. The walk keeps the expected
    /// (replica, stage) and compares it with each attestation: the hot path is one
    /// comparison per field, and a mismatch is named by {_slotError}.
    function _readSlots(
        uint256 runId,
        uint64 step,
        bytes32 parent,
        uint256 replicaSet,
        uint32 stages,
        Attestation[] calldata attestations
    ) private view returns (address[] memory signers, bytes32[] memory contributions, bytes32[] memory shards) {
        signers = new address[](attestations.length);
        contributions = new bytes32[](attestations.length);
        shards = new bytes32[](stages);
        uint256 replica = _nextReplica(replicaSet, 0);
        uint256 stage = 0;
        for (uint256 i = 0; i < attestations.length; ++i) {
            Attestation calldata a = attestations[i];
            // Reading lossMicros validates it (an int64 must be sign-extended in calldata).
            if (a.replica != replica || a.stage != stage || a.replicaSet != replicaSet || a.lossMicros != a.lossMicros)
            {
                _slotError(attestations, i, replicaSet, stages);
            }
            // The set's first replica states each stage's shard; every later one must co-sign it.
            if (i < stages) {
                shards[i] = a.newShard;
            } else if (a.newShard != shards[stage]) {
                revert LedgerShardMismatch(a.stage, a.replica, shards[stage], a.newShard);
            }
            signers[i] = _attestationSigner(runId, step, parent, a);
            contributions[i] = a.contribution;
            if (++stage == stages && i + 1 < attestations.length) {
                stage = 0;
                replica = _nextReplica(replicaSet, replica + 1);
            }
        }
    }

    /// @dev Reverts unless `replicaSet` names only replicas of `run` and at least its
    /// `minReplicas`; returns how many it names.
    function _checkReplicaSet(Run storage run, uint256 replicaSet) private view returns (uint256 present) {
        uint32 replicas = run.replicas;
        // replicas <= 256, and a shift by 256 gives 0: a full 256-replica set passes.
        if (replicaSet >> replicas != 0) revert LedgerReplicaSetOutOfRange(replicaSet, replicas);
        present = _popcount(replicaSet);
        if (present < run.minReplicas) revert LedgerTooFewReplicas(present, run.minReplicas);
    }

    /// @dev Names why attestation `index` is not slot `index` of a step over `replicaSet`,
    /// by reverting: signed over another set; for a replica outside the set; a stage out of
    /// range, or a slot repeated or out of place (its expected slot comes later); or the
    /// expected slot (a stage of a present replica) missing from the list. Only failing
    /// commits come here, so the scan for the expected slot costs nothing on the hot path.
    function _slotError(Attestation[] calldata attestations, uint256 index, uint256 replicaSet, uint32 stages)
        private
        pure
    {
        Attestation calldata a = attestations[index];
        if (a.replicaSet != replicaSet) revert LedgerReplicaSetMismatch(index, replicaSet, a.replicaSet);
        if ((replicaSet >> a.replica) & 1 == 0) revert LedgerReplicaNotInSet(a.replica, replicaSet);
        uint32 replica = _replicaAt(replicaSet, index / stages);
        // casting to 'uint32' is safe because it is below the run's uint32 stages
        // forge-lint: disable-next-line(unsafe-typecast)
        uint32 stage = uint32(index % stages);
        if (a.stage < stages && (a.replica > replica || (a.replica == replica && a.stage > stage))) {
            bool later = false;
            for (uint256 j = index + 1; j < attestations.length && !later; ++j) {
                later = attestations[j].replica == replica && attestations[j].stage == stage;
            }
            if (!later) revert LedgerMissingStage(replica, stage);
        }
        revert LedgerSlotOutOfOrder(index, a.replica, a.stage);
    }

    /// @dev The lowest replica id at or above `from` in `replicaSet`; the caller knows one is.
    function _nextReplica(uint256 replicaSet, uint256 from) private pure returns (uint256 replica) {
        replica = from;
        while ((replicaSet >> replica) & 1 == 0) {
            ++replica;
        }
    }

    /// @dev The node that signed slot (`replica`, `stage`) of a step over `replicaSet`, given
    /// the step's signers in slot order (checked against its witness hash, so `signers` has
    /// one entry per slot of the set); reverts if the replica is not in the set. The
    /// replica's slots follow those of the set's replicas below it.
    function _slotSigner(
        address[] calldata signers,
        uint256 replicaSet,
        uint32 replica,
        uint32 stage,
        uint32 stages
    ) private pure returns (address) {
        if ((replicaSet >> replica) & 1 == 0) revert LedgerReplicaNotInSet(replica, replicaSet);
        uint256 below = replicaSet & ((uint256(1) << replica) - 1);
        return signers[_popcount(below) * stages + stage];
    }

    /// @dev The replica id at position `position` (0-based, ascending) of `replicaSet`.
    function _replicaAt(uint256 replicaSet, uint256 position) private pure returns (uint32) {
        uint256 replica = _nextReplica(replicaSet, 0);
        for (uint256 p = 0; p < position; ++p) {
            replica = _nextReplica(replicaSet, replica + 1);
        }
        // casting to 'uint32' is safe because a replica id is below 256
        // forge-lint: disable-next-line(unsafe-typecast)
        return uint32(replica);
    }

    /// @dev The number of set bits of `x` (one loop turn per bit).
    function _popcount(uint256 x) private pure returns (uint256 count) {
        unchecked {
            while (x != 0) {
                x &= x - 1;
                ++count;
            }
        }
    }

    /// @dev Reverts unless every one of `signers` is a member of `run` with an active stake of
    /// at least the run's minimum (and above zero), and the replicas are independent
    /// ({_checkIndependent}).
    ///
    /// The check is cached per run: a run's minimum and independence mode never change, nor
    /// does a node's operator, members only join (a leave clears the cache), and a node's active stake only ever drops through
    /// {INodeRegistry-unbond} or a slash, each of which bumps the registry's
    /// {INodeRegistry-stakeDecreases} counter. So when this step's signer list is the one
    /// last checked and the counter has not moved since, every signer is still eligible and
    /// the replicas still independent, and the per-signer reads (a membership slot here and
    /// a stake slot in the registry, both cold) are skipped. Steady runs sign with the same
    /// nodes every step.
    function _checkEligible(
        Run storage run,
        uint256 runId,
        address[] memory signers,
        bytes32 signersHash,
        uint256 replicaSet
    ) private {
        uint64 decreases = _registry.stakeDecreases();
        EligibleSigners storage cache = run.eligible;
        if (cache.signers == bytes24(signersHash) && cache.atDecreases == decreases) return;

        for (uint256 i = 0; i < signers.length; ++i) {
            uint8 membership = run.members[signers[i]];
            if (membership != _FOUNDER && membership != _JOINED) revert LedgerNotMember(runId, signers[i]);
        }
        // One call for all stakes: a call per signer would cost more than the reads.
        uint256 required = _required(run.minStake);
        uint256[] memory stakes = _registry.stakesOf(signers);
        for (uint256 i = 0; i < signers.length; ++i) {
            if (stakes[i] < required) revert LedgerInsufficientStake(signers[i], stakes[i], required);
        }
        _checkIndependent(run, signers, replicaSet);
        cache.signers = bytes24(signersHash);
        cache.atDecreases = decreases;
    }

    /// @dev Reverts with {LedgerNotIndependent} if a witness (the node key, or under
    /// `Operators` its operator) signs slots of two replicas. Slots are replica-major, so each
    /// slot is compared with the slots of the replicas before its own: quadratic in the
    /// slots, and run only when the eligibility cache misses. The error names replica ids
    /// (positions in `replicaSet` mapped back).
    function _checkIndependent(Run storage run, address[] memory signers, uint256 replicaSet) private view {
        address[] memory witnesses =
            run.independence == Independence.Operators ? _registry.operatorsOf(signers) : signers;
        uint256 stages = run.stages;
        for (uint256 i = stages; i < witnesses.length; ++i) {
            uint256 replicaStart = i - i % stages;
            for (uint256 j = 0; j < replicaStart; ++j) {
                if (witnesses[i] == witnesses[j]) {
                    revert LedgerNotIndependent(
                        signers[i], _replicaAt(replicaSet, j / stages), _replicaAt(replicaSet, i / stages)
                    );
                }
            }
        }
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

    /// @dev Reverts unless `signers`, `shardsRoot` and `replicaSet` hash to `record`'s
    /// witness hash.
    function _checkWitnesses(
        StepInfo storage record,
        address[] calldata signers,
        bytes32 shardsRoot,
        uint256 replicaSet
    ) private view {
        bytes20 got = _witnessHash(keccak256(abi.encodePacked(signers)), shardsRoot, replicaSet);
        if (got != record.witnessHash) revert LedgerWitnessMismatch(record.witnessHash, got);
    }

    /// @dev The co-signers of stage `stage`'s shard in `record`, in replica order, given the
    /// record's replica set, its signers in slot order and its co-signed shards in stage order.
    function _coSignersAt(
        Run storage run,
        uint256 runId,
        StepInfo storage record,
        uint32 stage,
        uint256 replicaSet,
        address[] calldata signers,
        bytes32[] calldata shards
    ) private view returns (address[] memory coSigners) {
        uint32 stages = run.stages;
        if (stage >= stages) revert LedgerSlotOutOfRange(runId, 0, stage);
        _checkWitnesses(record, signers, keccak256(abi.encodePacked(shards)), replicaSet);
        // A matching hash means `signers` has one entry per slot of the set and `shards` stages.
        coSigners = new address[](signers.length / stages);
        for (uint256 r = 0; r < coSigners.length; ++r) {
            coSigners[r] = signers[r * stages + stage];
        }
    }

    /// @dev What a step record keeps of its witnesses: see {ITrainingLedger-StepInfo}.
    function _witnessHash(bytes32 signersHash, bytes32 shardsRoot, uint256 replicaSet) private pure returns (bytes20) {
        return bytes20(keccak256(abi.encode(signersHash, shardsRoot, replicaSet)));
    }

    /// @dev Checks the challenger's stake and bond against `run`'s minimum and stores a new
    /// challenge of step `step`'s record against `node`; returns its id.
    function _storeChallenge(
        Run storage run,
        uint256 runId,
        uint64 step,
        uint32 replica,
        uint32 stage,
        address node,
        bool aggregate
    ) private returns (uint256 challengeId) {
        uint256 required = _required(run.minStake);
        uint256 staked = _registry.stakeOf(msg.sender);
        if (staked < required) revert LedgerInsufficientStake(msg.sender, staked, required);
        if (msg.value < required) revert LedgerInsufficientBond(required, msg.value);

        challengeId = ++_challengeCount;
        StepInfo storage record = run.steps[step];
        _challenges[challengeId] = Challenge({
            runId: runId,
            step: step,
            epoch: record.epoch,
            replica: replica,
            stage: stage,
            resolved: false,
            aggregate: aggregate,
            openedAt: uint40(block.timestamp),
            node: node,
            challenger: msg.sender,
            bond: msg.value
        });
        record.openChallenges += 1;
    }

    /// @dev The nodes challenge `c` holds: its co-signers for an aggregate challenge, else its node.
    function _answering(Challenge storage c, uint256 challengeId) private view returns (address[] memory nodes) {
        if (c.aggregate) return _coSigners[challengeId];
        nodes = new address[](1);
        nodes[0] = c.node;
    }

    /// @dev Records the offence of each of `nodes` (challenge `c` upheld) and sets `slash[i]`
    /// where node i was not slashed for it before; returns whether any was.
    function _markOffences(Challenge storage c, address[] memory nodes, bool[] memory slash)
        private
        returns (bool any)
    {
        uint8 kind = c.aggregate ? _BAD_AGGREGATE : _FAILED_REPLAY;
        bytes32 epoch = bytes32(uint256(c.epoch));
        for (uint256 i = 0; i < nodes.length; ++i) {
            // An aggregate offence's replica is the co-signer's position in the step's set.
            // casting to 'uint32' is safe because i is below the run's uint32 replicas
            // forge-lint: disable-next-line(unsafe-typecast)
            uint32 replica = c.aggregate ? uint32(i) : c.replica;
            bytes32 offence = offenceId(kind, c.runId, c.step, replica, c.stage, epoch, nodes[i]);
            if (!_slashed[offence]) {
                _slashed[offence] = true;
                slash[i] = true;
                any = true;
            }
        }
    }

    /// @dev Releases challenge `c`'s bond (held against `nodes[0]`) to `payee` and the holds
    /// on its further co-signers.
    function _release(Challenge storage c, address[] memory nodes, address payee) private {
        _registry.releaseBond(nodes[0], payee, c.bond);
        for (uint256 i = 1; i < nodes.length; ++i) {
            // slither-disable-next-line calls-loop -- the registry is this ledger's own, fixed at deployment.
            _registry.releaseNode(nodes[i]);
        }
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
        return ECDSA.recover(_hashTypedDataV4(_contributionHash(runId, step, parent, a)), a.r, a.vs);
    }

    /// @dev The EIP-712 `hashStruct` of the `Contribution` that `a` attests, built in scratch
    /// memory past the free memory pointer: commitStep hashes one per slot, and allocating a
    /// struct and its encoding each time would grow memory with every attestation.
    /// `Attestation`'s first eight fields are in `Contribution` order around `parent`:
    /// replica, stage and replicaSet at offsets 0x00 to 0x5f; contribution, dataShard,
    /// codeHash, lossMicros and newShard from 0x60 to 0xff. Callers validate the fields they
    /// read (commitStep reads them all), and a dirty word only hashes to a message nobody
    /// signed.
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
            calldatacopy(add(m, 0x60), a, 0x60)
            mstore(add(m, 0xc0), parent)
            calldatacopy(add(m, 0xe0), add(a, 0x60), 0xa0)
            structHash := keccak256(m, 0x180)
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
