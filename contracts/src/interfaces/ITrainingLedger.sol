// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

/// @title ITrainingLedger
/// @notice The on-chain lineage of DiLoCoX training runs: one record per outer step, each
/// backed by one EIP-712 attestation per (replica, stage) slot of the replicas that took part
/// in the step (its replica set: at least the run's `minReplicas` of its `replicas`, every
/// stage of each) from a staked member node.
/// @dev Digests are the 32-byte sha2-256 digests of CIDs (DESIGN.md section 4): the
/// checkpoint manifest (dag-cbor) and each contribution (UnixFS file).
interface ITrainingLedger {
    /// @notice What makes the replicas of a step independent witnesses, fixed per run:
    /// `Keys`, a node key signs the slots of at most one replica per step; `Operators`, the
    /// nodes of one operator (the registry's {INodeRegistry-operatorOf}) sign the slots of at
    /// most one replica per step. Either way a node may hold several stages of its replica.
    enum Independence {
        Keys,
        Operators
    }

    /// @notice One node's signed statement about the work of its (replica, stage) slot.
    /// @param replica The data-parallel replica id, below the run's `replicas`; ids never
    /// change meaning (data shards, seeds and slots are by id), whoever is present.
    /// @param stage The pipeline stage index, below the run's `stages`.
    /// @param replicaSet The replicas present in the step, as a bitmap (bit r set: replica r
    /// took part), that the node signed over: the outer step it co-signs averages exactly
    /// those replicas' contributions.
    /// @param contribution Digest of the compressed contribution the node produced.
    /// @param dataShard Digest of the data shard the node trained on.
    /// @param codeHash Hash of the trainer source that ran.
    /// @param lossMicros The node's training loss times 1e6.
    /// @param newShard Digest of the new outer shard of its stage that the node computed
    /// itself after the outer step (the UnixFS file CID of the shard's bytes): every replica
    /// of a stage computes the same outer step, so the replicas co-sign the aggregate.
    /// @param r The signature's r.
    /// @param vs The signature's s with the parity of its y in the top bit (EIP-2098): the
    /// EIP-712 signature over `Contribution(...)` by the node key, in 64 bytes. A static
    /// struct, so calldata carries no offsets or lengths for it.
    struct Attestation {
        uint32 replica;
        uint32 stage;
        uint256 replicaSet;
        bytes32 contribution;
        bytes32 dataShard;
        bytes32 codeHash;
        int64 lossMicros;
        bytes32 newShard;
        bytes32 r;
        bytes32 vs;
    }

    /// @notice What the ledger knows about one committed step (step 0 is the genesis).
    /// @param checkpoint Digest of the step's checkpoint manifest.
    /// @param witnessHash The first 20 bytes of `keccak256(abi.encode(signersHash,
    /// shardsRoot, replicaSet))`: `signersHash` is keccak256 of the attesting node keys in
    /// slot order (each padded to 32 bytes, as `abi.encodePacked(address[])` does),
    /// `shardsRoot` keccak256 of the co-signed stage shard digests in stage order and
    /// `replicaSet` the step's replica bitmap (see {StepCommitted}). It binds who attested,
    /// for which replicas, and what result they co-signed; it never changes.
    /// @param committedAt Block timestamp of the commit; the challenge window starts here.
    /// @param epoch The run's rollback count when the step was committed.
    /// @param openChallenges Challenges opened against this record and not yet resolved.
    /// @param rejected Whether an upheld challenge rejected the step or an ancestor.
    /// @dev Two storage slots: everything but the checkpoint packs into the second, which
    /// saves a 22,100-gas slot on every commit. (uint40 seconds last until the year 36812;
    /// a step can hold 65,535 open challenges, each bonded.)
    struct StepInfo {
        bytes32 checkpoint;
        bytes20 witnessHash;
        uint40 committedAt;
        uint32 epoch;
        uint16 openChallenges;
        bool rejected;
    }

    /// @notice A challenge against one committed step: a replay challenge against the node
    /// of one slot, or an aggregate challenge against every co-signer of one stage's shard.
    /// @param runId The run.
    /// @param step The challenged step.
    /// @param epoch The epoch of the challenged step record (a rollback makes it stale).
    /// @param replica The challenged slot's replica id (0 for an aggregate challenge).
    /// @param stage The challenged slot's (or co-signed shard's) stage.
    /// @param resolved Whether the arbiters have ruled.
    /// @param aggregate Whether it disputes the stage's co-signed shard (all its co-signers,
    /// {coSignersOf}) rather than one slot's replay.
    /// @param node The node key that attested the slot (aggregate: replica 0's co-signer).
    /// @param challenger The staked verifier that opened the challenge and posted the bond.
    /// @param bond The bond in wei.
    struct Challenge {
        uint256 runId;
        uint64 step;
        uint32 epoch;
        uint32 replica;
        uint32 stage;
        bool resolved;
        bool aggregate;
        uint40 openedAt;
        address node;
        address challenger;
        uint256 bond;
    }

    /// @notice No run has id `runId`.
    error LedgerUnknownRun(uint256 runId);

    /// @notice A run needs one to 256 replicas (a step's replica set is a 256-bit map) and at
    /// least one stage.
    error LedgerInvalidShape(uint32 replicas, uint32 stages);

    /// @notice A run's `minReplicas` must be between 1 and its `replicas`.
    error LedgerInvalidMinReplicas(uint32 minReplicas, uint32 replicas);

    /// @notice The step's replica set names `present` replicas, fewer than the run's
    /// `minReplicas`.
    error LedgerTooFewReplicas(uint256 present, uint32 minReplicas);

    /// @notice The step's replica set `replicaSet` has a bit at or above the run's `replicas`.
    error LedgerReplicaSetOutOfRange(uint256 replicaSet, uint32 replicas);

    /// @notice Replica `replica` is not in the replica set `replicaSet` (an attestation for a
    /// replica the step does not name, or a challenge of a slot the step did not have).
    error LedgerReplicaNotInSet(uint32 replica, uint256 replicaSet);

    /// @notice Attestation `index` was signed over the replica set `got`, not the step's
    /// `expected` one.
    error LedgerReplicaSetMismatch(uint256 index, uint256 expected, uint256 got);

    /// @notice The step names replica `replica` but has no attestation for its stage `stage`
    /// (slots run replica by replica in ascending id, each replica's stages in order).
    error LedgerMissingStage(uint32 replica, uint32 stage);

    /// @notice The two attestations were signed over different replica sets, `replicaSetA`
    /// and `replicaSetB`: after a membership change a node may sign the same step again for
    /// another set, which is no equivocation.
    error LedgerDifferentReplicaSets(uint256 replicaSetA, uint256 replicaSetB);

    /// @notice A run needs at least one node.
    error LedgerNoNodes();

    /// @notice `node` appears twice in a run's node list.
    error LedgerDuplicateNode(address node);

    /// @notice `quorum` is zero with arbiters, or above the number of arbiters.
    error LedgerInvalidQuorum(uint32 quorum, uint256 arbiters);

    /// @notice A genesis or checkpoint digest is zero.
    error LedgerZeroDigest();

    /// @notice The committed step is not the one after the head.
    error LedgerWrongStep(uint64 expected, uint64 got);

    /// @notice The committed step's parent is not the run's head.
    error LedgerStaleParent(bytes32 expected, bytes32 got);

    /// @notice There are more attestations than the replica set's replicas * stages.
    error LedgerWrongAttestationCount(uint256 expected, uint256 got);

    /// @notice Attestation `index` is not for slot `index` (slot = position * stages + stage,
    /// position the replica's rank among the set's replicas): a stage out of range, or a slot
    /// repeated or out of order.
    error LedgerSlotOutOfOrder(uint256 index, uint32 replica, uint32 stage);

    /// @notice The attestation was signed by `node`, which is not a member of the run.
    error LedgerNotMember(uint256 runId, address node);

    /// @notice `node` stakes `stake` wei, below the `required` amount.
    error LedgerInsufficientStake(address node, uint256 stake, uint256 required);

    /// @notice `node` signed slots of replica `replicaA` and of replica `replicaB` in one step
    /// (under `Operators` independence: `node`'s operator had already signed for `replicaA`).
    error LedgerNotIndependent(address node, uint32 replicaA, uint32 replicaB);

    /// @notice Replica `replica` co-signed `got` as stage `stage`'s new shard, where the
    /// replicas before it co-signed `expected`.
    error LedgerShardMismatch(uint32 stage, uint32 replica, bytes32 expected, bytes32 got);

    /// @notice A run's independence mode is not one of {Independence}.
    error LedgerInvalidIndependence(uint8 independence);

    /// @notice The two attestations are for different stages, `stageA` and `stageB`.
    error LedgerDifferentStages(uint32 stageA, uint32 stageB);

    /// @notice The two attestations co-sign the same shard `shard`.
    error LedgerSameShard(bytes32 shard);

    /// @notice The contributions root does not hash the attested contributions.
    error LedgerContributionsRootMismatch(bytes32 expected, bytes32 got);

    /// @notice `window` is not below the registry's unbonding delay, so unbonding could
    /// outrun a challenge; the longest window allowed is `maximum`.
    error LedgerWindowTooLong(uint64 window, uint64 maximum);

    /// @notice `arbiter` appears twice in a run's arbiter list, or is the zero address.
    error LedgerInvalidArbiter(address arbiter);

    /// @notice Step `step` of run `runId` is not a committed step on the run's chain.
    error LedgerUnknownStep(uint256 runId, uint64 step);

    /// @notice Step `step` of run `runId` was rejected.
    error LedgerStepRejected(uint256 runId, uint64 step);

    /// @notice Step `step` of run `runId` is final.
    error LedgerStepFinalized(uint256 runId, uint64 step);

    /// @notice The challenge window of step `step` of run `runId` closed at `deadline`.
    error LedgerWindowClosed(uint256 runId, uint64 step, uint64 deadline);

    /// @notice The challenge window of step `step` of run `runId` is open until `deadline`.
    error LedgerWindowOpen(uint256 runId, uint64 step, uint64 deadline);

    /// @notice Step `step` of run `runId` has `openChallenges` unresolved challenges.
    error LedgerStepChallenged(uint256 runId, uint64 step, uint256 openChallenges);

    /// @notice Step `step` of run `runId` cannot be final before step `step - 1` is.
    error LedgerParentNotFinal(uint256 runId, uint64 step);

    /// @notice Slot (`replica`, `stage`) is outside run `runId`'s shape.
    error LedgerSlotOutOfRange(uint256 runId, uint32 replica, uint32 stage);

    /// @notice The node list and shards root given do not hash to the step's witness hash.
    error LedgerWitnessMismatch(bytes20 expected, bytes20 got);

    /// @notice The two attestations are for different slots: (`replicaA`, `stageA`) and
    /// (`replicaB`, `stageB`).
    error LedgerDifferentSlots(uint32 replicaA, uint32 stageA, uint32 replicaB, uint32 stageB);

    /// @notice The two attestations carry the same contribution `contribution`.
    error LedgerSameContribution(bytes32 contribution);

    /// @notice The two attestations were signed by different keys, `a` and `b`.
    error LedgerSignerMismatch(address a, address b);

    /// @notice `node` was already slashed for offence `offence`.
    error LedgerAlreadySlashed(bytes32 offence, address node);

    /// @notice Run `runId` has no arbiters, so its steps cannot be challenged.
    error LedgerNoArbiters(uint256 runId);

    /// @notice The bond `got` is below the `required` amount.
    error LedgerInsufficientBond(uint256 required, uint256 got);

    /// @notice No challenge has id `challengeId`.
    error LedgerUnknownChallenge(uint256 challengeId);

    /// @notice Challenge `challengeId` was already resolved.
    error LedgerChallengeResolved(uint256 challengeId);

    /// @notice Challenge `challengeId` is still within its resolution period, until `deadline`.
    error LedgerResolutionPending(uint256 challengeId, uint256 deadline);

    /// @notice A verdict was signed by `signer`, not an arbiter of run `runId`.
    error LedgerNotArbiter(uint256 runId, address signer);

    /// @notice Verdict signature `index` is not from a key above the previous one (verdicts
    /// are sorted by signer address, which rules out counting one arbiter twice).
    error LedgerVerdictsNotSorted(uint256 index, address signer);

    /// @notice `got` arbiter signatures are below the run's quorum `quorum`.
    error LedgerQuorumNotReached(uint256 got, uint256 quorum);

    /// @notice Run `runId` was created; its head is `genesisDigest` at step 0.
    event RunCreated(
        uint256 indexed runId,
        address indexed creator,
        bytes32 configDigest,
        bytes32 genesisDigest,
        uint32 replicas,
        uint32 stages,
        uint32 minReplicas,
        address[] nodes,
        Independence independence
    );

    /// @notice Outer step `step` of run `runId` moved the head from `parent` to `checkpoint`;
    /// `shardsRoot` is keccak256 of the stage shard digests its replicas co-signed, in stage
    /// order (each {ContributionAttested} carries its stage's digest), and `replicaSet` the
    /// bitmap of the replicas that took part (bit r: replica r), whose slots follow.
    event StepCommitted(
        uint256 indexed runId,
        uint64 indexed step,
        bytes32 indexed checkpoint,
        bytes32 parent,
        bytes32 contributionsRoot,
        bytes32 metricsDigest,
        address submitter,
        bytes32 shardsRoot,
        uint256 replicaSet
    );

    /// @notice `node` attested its contribution to slot (`replica`, `stage`) of step `step`
    /// and co-signed `newShard` as the stage's new outer shard (signed over the step's
    /// replica set, which its {StepCommitted} carries).
    event ContributionAttested(
        uint256 indexed runId,
        uint64 indexed step,
        address indexed node,
        uint32 replica,
        uint32 stage,
        bytes32 contribution,
        bytes32 dataShard,
        bytes32 codeHash,
        int64 lossMicros,
        bytes32 newShard
    );

    /// @notice `node` signed two different contributions, `contributionA` and
    /// `contributionB`, for slot (`replica`, `stage`) of step `step` on top of `parent`, both
    /// over one replica set;
    /// `reporter` proved it (the registry's {INodeRegistry-Slashed} event has the amounts).
    event EquivocationSlashed(
        uint256 indexed runId,
        uint64 indexed step,
        address indexed node,
        uint32 replica,
        uint32 stage,
        bytes32 parent,
        bytes32 contributionA,
        bytes32 contributionB,
        address reporter
    );

    /// @notice `node` co-signed two different shards, `shardA` and `shardB`, as stage
    /// `stage`'s new shard at step `step` on top of `parent`, both over one replica set;
    /// `reporter` proved it.
    event ResultEquivocationSlashed(
        uint256 indexed runId,
        uint64 indexed step,
        address indexed node,
        uint32 stage,
        bytes32 parent,
        bytes32 shardA,
        bytes32 shardB,
        address reporter
    );

    /// @notice `challenger` disputed the work of `node` in slot (`replica`, `stage`) of step
    /// `step` (record epoch `epoch`), posting
    /// `bond` wei; `evidence` is a digest of its replay report. An aggregate challenge
    /// ({openAggregateChallenge}) also emits {AggregateChallenged}.
    event ChallengeOpened(
        uint256 indexed challengeId,
        uint256 indexed runId,
        uint64 indexed step,
        address node,
        uint32 epoch,
        uint32 replica,
        uint32 stage,
        address challenger,
        uint256 bond,
        bytes32 evidence
    );

    /// @notice Challenge `challengeId` disputes stage `stage`'s co-signed shard `shard`;
    /// `coSigners` (one per replica of the step's set, in replica order) answer for it
    /// together.
    event AggregateChallenged(uint256 indexed challengeId, uint32 stage, bytes32 shard, address[] coSigners);

    /// @notice No verdict on challenge `challengeId` came within the resolution period: it is
    /// dismissed without a ruling, the bond goes back to the challenger, the node is free
    /// to withdraw again and the step may be finalized.
    event ChallengeExpired(uint256 indexed challengeId, uint256 indexed runId, uint64 step, address indexed node);

    /// @notice The arbiters ruled on challenge `challengeId`: `upheld` or not. `slashed` says
    /// whether the node is slashed now (not when already slashed for this offence); the
    /// registry's {INodeRegistry-Slashed} event has the amounts. An upheld aggregate
    /// challenge slashes every co-signer, one {INodeRegistry-Slashed} each; `node` is the first.
    event ChallengeResolved(
        uint256 indexed challengeId, uint256 indexed runId, uint64 indexed step, address node, bool upheld, bool slashed
    );

    /// @notice Step `step` of run `runId` (checkpoint `checkpoint`) was rejected by the
    /// upheld challenge `challengeId`, against it or an ancestor.
    event StepRejected(uint256 indexed runId, uint64 indexed step, bytes32 indexed checkpoint, uint256 challengeId);

    /// @notice The head of run `runId` rolled back from step `fromStep` to step `toStep`,
    /// whose checkpoint `head` is the new head.
    event HeadRolledBack(uint256 indexed runId, uint64 fromStep, uint64 toStep, bytes32 head);

    /// @notice Step `step` of run `runId` (checkpoint `checkpoint`) is final.
    event StepFinalized(uint256 indexed runId, uint64 indexed step, bytes32 indexed checkpoint);

    /// @notice Records outer step `step` of run `runId`. Anyone may submit: the attestations'
    /// signatures are the authority.
    /// @dev Emits a {StepCommitted} event, then one {ContributionAttested} event per
    /// attestation, in slot order.
    ///
    /// Requirements:
    ///
    /// - run `runId` exists;
    /// - `step` is the run's head step plus one;
    /// - `parent` is the run's head;
    /// - `checkpoint` is not zero;
    /// - `replicaSet` (bit r: replica r took part) has no bit at or above the run's
    ///   `replicas` and at least its `minReplicas` bits;
    /// - there is exactly one attestation per (replica in the set, stage), replica by
    ///   replica in ascending id and each replica's stages in order: attestation i is for
    ///   slot i (slot = position * stages + stage, position the replica's rank in the set);
    /// - every attestation carries `replicaSet` and is signed over (`runId`, `step`,
    ///   `parent`, its fields) by a member of the run whose registry stake is at least the
    ///   run's minimum and above zero;
    /// - the replicas are independent: no node (under `Operators`, no operator's nodes)
    ///   signs slots of two replicas;
    /// - every replica of a stage co-signs the same `newShard`;
    /// - `contributionsRoot` is keccak256 of the contributions concatenated in slot order.
    function commitStep(
        uint256 runId,
        uint64 step,
        bytes32 parent,
        bytes32 checkpoint,
        bytes32 contributionsRoot,
        bytes32 metricsDigest,
        uint256 replicaSet,
        Attestation[] calldata attestations
    ) external;

    /// @notice Slashes a node that signed two different contributions for the same slot of
    /// the same step on top of the same parent; pays the caller the reporter's share.
    /// Trustless: the two signatures are the proof. Returns the wei slashed.
    /// @dev Emits an {EquivocationSlashed} event (and the registry's {Slashed}).
    /// The parent is part of the offence so that an honest node re-attesting a step after a
    /// rollback (a new parent) is not an equivocation.
    ///
    /// Requirements:
    ///
    /// - run `runId` exists;
    /// - `a` and `b` are for the same (replica, stage), signed over the same replica set,
    ///   and carry different contributions;
    /// - both are signed over (`runId`, `step`, `parent`, their fields) by one member node;
    /// - that node was not slashed for this (run, step, replica, stage, parent) before (under
    ///   any replica set: one slash per slot and parent).
    function reportEquivocation(
        uint256 runId,
        uint64 step,
        bytes32 parent,
        Attestation calldata a,
        Attestation calldata b
    ) external returns (uint256 slashed);

    /// @notice Slashes a node that co-signed two different new shards for the same stage of
    /// the same step on top of the same parent (for any replicas); pays the caller the
    /// reporter's share. Trustless, as {reportEquivocation}. Returns the wei slashed.
    /// @dev Emits a {ResultEquivocationSlashed} event (and the registry's {Slashed}).
    ///
    /// Requirements:
    ///
    /// - run `runId` exists;
    /// - `a` and `b` are for the same stage, signed over the same replica set, and carry
    ///   different `newShard`s;
    /// - both are signed over (`runId`, `step`, `parent`, their fields) by one member node;
    /// - that node was not slashed for this (run, step, stage, parent) result before.
    function reportResultEquivocation(
        uint256 runId,
        uint64 step,
        bytes32 parent,
        Attestation calldata a,
        Attestation calldata b
    ) external returns (uint256 slashed);

    /// @notice Opens a replay challenge against the node that attested slot (`replica`,
    /// `stage`) of step `step`; `msg.value` is the bond. Returns the challenge id (from 1).
    /// @dev Emits a {ChallengeOpened} event (and the registry's {BondHeld}).
    ///
    /// Requirements:
    ///
    /// - run `runId` exists and has arbiters;
    /// - `step` is a committed, non-rejected, non-final step, within its challenge window;
    /// - the slot is inside the run's shape;
    /// - `signers` are the step's attesting nodes in slot order, `shardsRoot` its shards
    ///   root and `replicaSet` its replica set (all from its events), and `replica` is in
    ///   the set;
    /// - the caller is a node whose active stake is at least the run's minimum (and not 0);
    /// - the bond is at least the run's minimum stake (and not 0).
    function openChallenge(
        uint256 runId,
        uint64 step,
        uint32 replica,
        uint32 stage,
        uint256 replicaSet,
        address[] calldata signers,
        bytes32 shardsRoot,
        bytes32 evidence
    ) external payable returns (uint256 challengeId);

    /// @notice Opens an aggregate challenge against stage `stage` of step `step`: the shard
    /// its replicas co-signed (`shards[stage]`) is not the outer step recomputed from the
    /// parent shard and the published contributions of the step's replica set (verify
    /// level 3). Every co-signer
    /// answers for it: none may withdraw while it is open, and an upheld verdict slashes them
    /// all. `msg.value` is the bond. Returns the challenge id.
    /// @dev Emits {ChallengeOpened} and {AggregateChallenged} (and the registry's {BondHeld}
    /// and one {INodeRegistry-NodeHeld} per further co-signer).
    ///
    /// Requirements: as {openChallenge}, with `shards` the step's co-signed digests in stage
    /// order (keccak256 of them is its shards root), `replicaSet` the step's replica set and
    /// `stage` below the run's stages.
    function openAggregateChallenge(
        uint256 runId,
        uint64 step,
        uint32 stage,
        uint256 replicaSet,
        address[] calldata signers,
        bytes32[] calldata shards,
        bytes32 evidence
    ) external payable returns (uint256 challengeId);

    /// @notice Resolves challenge `challengeId` with a quorum of the run's arbiters' EIP-712
    /// `Verdict(challengeId, upheld)` signatures. Upheld: the node is slashed (the challenger
    /// is paid the reporter's share and its bond back), and if the challenged step is still
    /// on the chain, it and every descendant are rejected and the head rolls back to its
    /// parent. Not upheld: the bond goes to the node's operator.
    /// @dev Emits a {ChallengeResolved} event; when upheld, one {StepRejected} per rejected
    /// step and a {HeadRolledBack} event.
    ///
    /// Requirements:
    ///
    /// - challenge `challengeId` exists and is unresolved;
    /// - at least `quorum` signatures, each by a distinct arbiter of the run, sorted by
    ///   ascending signer address.
    function resolveChallenge(uint256 challengeId, bool upheld, bytes[] calldata signatures) external;

    /// @notice Dismisses challenge `challengeId` without a ruling once its resolution period
    /// has passed: a quorum that never rules must not hold the bond, the node's stake and the
    /// step's finality forever. Anyone may call it. The bond goes back to the challenger; the
    /// node is not slashed and its step stays as it is (finalizable once its window closed).
    /// @dev Emits a {ChallengeExpired} event (and the registry's {BondReleased}).
    ///
    /// Requirements:
    ///
    /// - challenge `challengeId` exists and is unresolved;
    /// - more than {resolutionPeriod} seconds have passed since it was opened.
    function expireChallenge(uint256 challengeId) external;

    /// @notice Makes step `step` of run `runId` final. Anyone may call it.
    /// @dev Emits a {StepFinalized} event.
    ///
    /// Requirements:
    ///
    /// - `step` is a committed step of the run's chain and not final yet;
    /// - step `step - 1` is final (the genesis is);
    /// - its challenge window has passed and no challenge against it is open.
    function finalize(uint256 runId, uint64 step) external;

    /// @notice The EIP-712 type hash of `Contribution`.
    // slither-disable-next-line naming-convention -- a constant's getter, named as the constant.
    function CONTRIBUTION_TYPEHASH() external view returns (bytes32);

    /// @notice The EIP-712 type hash of `Verdict(uint256 challengeId,bool upheld)`.
    // slither-disable-next-line naming-convention -- a constant's getter, named as the constant.
    function VERDICT_TYPEHASH() external view returns (bytes32);

    /// @notice The EIP-712 digest an arbiter signs to rule on a challenge.
    function verdictDigest(uint256 challengeId, bool upheld) external view returns (bytes32);

    /// @notice The longest challenge window a run may have (below the unbonding delay).
    function maxChallengeWindow() external view returns (uint64);

    /// @notice Seconds an opened challenge waits for a verdict before anyone may expire it
    /// (the registry's unbonding delay).
    function resolutionPeriod() external view returns (uint64);

    /// @notice The stored record of step `step` of run `runId` (zeros if never committed).
    /// A rejected record stays readable until a new commit of the same step number.
    /// @dev Requirements: run `runId` exists.
    function stepInfo(uint256 runId, uint64 step) external view returns (StepInfo memory);

    /// @notice The latest final step of run `runId` (0, the genesis, at first).
    /// @dev Requirements: run `runId` exists.
    function finalizedStep(uint256 runId) external view returns (uint64);

    /// @notice The challenge window of run `runId`, in seconds.
    /// @dev Requirements: run `runId` exists.
    function challengeWindowOf(uint256 runId) external view returns (uint64);

    /// @notice The arbiters and quorum of run `runId`.
    /// @dev Requirements: run `runId` exists.
    function arbitersOf(uint256 runId) external view returns (address[] memory arbiters, uint32 quorum);

    /// @notice Challenge `challengeId`.
    /// @dev Requirements: the challenge exists.
    function challenge(uint256 challengeId) external view returns (Challenge memory);

    /// @notice The co-signers an aggregate challenge holds, one per replica of the step's set
    /// in replica order (empty for a replay challenge).
    /// @dev Requirements: the challenge exists.
    function coSignersOf(uint256 challengeId) external view returns (address[] memory);

    /// @notice The independence mode of run `runId`'s steps.
    /// @dev Requirements: run `runId` exists.
    function independenceOf(uint256 runId) external view returns (Independence);

    /// @notice The number of challenges opened so far (also the latest id).
    function challengeCount() external view returns (uint256);

    /// @notice Whether a slash was already taken for offence `offence` (see {offenceId}).
    function isSlashed(bytes32 offence) external view returns (bool);

    /// @notice The id of an offence by `node` at slot (`replica`, `stage`) of step `step`:
    /// `kind` 0 is an equivocation, `key` its parent; `kind` 1 a failed replay, `key` the
    /// challenged record's epoch; `kind` 2 a co-signed shard that is not the aggregate, `key`
    /// the epoch and `replica` the co-signer's position in the step's replica set (its
    /// replica id when the set is full); `kind` 3 a result equivocation, `key` the parent
    /// and `replica` type(uint32).max (any). One offence is slashed at most once.
    function offenceId(uint8 kind, uint256 runId, uint64 step, uint32 replica, uint32 stage, bytes32 key, address node)
        external
        pure
        returns (bytes32);

    /// @notice The registry whose stakes back attestations.
    function registry() external view returns (address);

    /// @notice The number of runs created so far (also the latest run id).
    function runCount() external view returns (uint256);

    /// @notice The head checkpoint of run `runId` and its step.
    /// @dev Requirements: run `runId` exists.
    function runHead(uint256 runId) external view returns (bytes32 head, uint64 step);

    /// @notice The checkpoint at `step` on run `runId`'s current chain (step 0 is the
    /// genesis), or zero beyond the head (not committed yet, or rejected).
    /// @dev Requirements: run `runId` exists.
    function stepCheckpoint(uint256 runId, uint64 step) external view returns (bytes32);

    /// @notice Whether `node` is a member of run `runId` (false for an unknown run).
    function isMember(uint256 runId, address node) external view returns (bool);

    /// @notice The EIP-712 digest a node signs for attestation `a` (its signature fields are
    /// ignored), for off-chain checks.
    function contributionDigest(uint256 runId, uint64 step, bytes32 parent, Attestation calldata a)
        external
        view
        returns (bytes32);

    // ------------------------------------------------------------ membership and rewards (issue 35)

    /// @notice Who may join a run after its creation: `Closed`, nobody (the members named at
    /// creation, as before issue 35); `Open`, any registered node with at least the run's
    /// `minStake` of stake not locked by other runs; `Approved`, a node holding an EIP-712
    /// `Admission(runId, node, expiry)` signed by the run's creator.
    enum Admission {
        Closed,
        Open,
        Approved
    }

    /// @notice Everything {createRun} takes, as one struct (ABI: a tuple).
    /// @param admission An {Admission} value.
    /// @param rewardPerStep Wei the pool pays out per final step, split over its attested slots.
    struct RunSpec {
        bytes32 configDigest;
        bytes32 genesisDigest;
        address[] nodes;
        uint32 replicas;
        uint32 stages;
        uint32 minReplicas;
        uint64 challengeWindow;
        uint256 minStake;
        address[] arbiters;
        uint32 quorum;
        uint8 independence;
        uint8 admission;
        uint128 rewardPerStep;
    }

    /// @notice What {finalizeSteps} needs of a step to pay it: its signers in slot order, its
    /// shards root and replica set (as in {openChallenge}; all three are in the step's logs).
    struct StepWitness {
        address[] signers;
        bytes32 shardsRoot;
        uint256 replicaSet;
    }

    /// @notice `admission` is not an {Admission} value.
    error LedgerInvalidAdmission(uint8 admission);

    /// @notice Run `runId` admits nobody after its creation.
    error LedgerRunClosed(uint256 runId);

    /// @notice Run `runId` admits only nodes with a signed admission, and none was given.
    error LedgerAdmissionRequired(uint256 runId);

    /// @notice The admission presented for run `runId` expired at `expiry`.
    error LedgerAdmissionExpired(uint256 runId, uint64 expiry);

    /// @notice The admission presented for run `runId` was signed by `signer`, not by the
    /// run's creator `creator` (or it is for another run or node, which recovers another key).
    error LedgerAdmissionNotByCreator(uint256 runId, address creator, address signer);

    /// @notice `node` is already a member of run `runId`.
    error LedgerAlreadyMember(uint256 runId, address node);

    /// @notice Run `runId` has ended: no joins and no commits.
    error LedgerRunEnded(uint256 runId);

    /// @notice Only run `runId`'s creator may do this; `caller` is not.
    error LedgerNotCreator(uint256 runId, address caller);

    /// @notice Run `runId` pays rewards, so its steps are final only through {finalizeSteps}.
    error LedgerRewardNeedsWitnesses(uint256 runId);

    /// @notice Run `runId`'s pool cannot be withdrawn before `until` (its end plus the
    /// unbonding delay).
    error LedgerPoolLocked(uint256 runId, uint64 until);

    /// @notice Run `runId` has non-final steps (final `finalized`, head `head`): its pool
    /// still owes them.
    error LedgerStepsNotFinal(uint256 runId, uint64 finalized, uint64 head);


    /// @notice Run `runId` admits nodes by `admission` and pays `rewardPerStep` a final step.
    event RunTermsSet(uint256 indexed runId, Admission admission, uint128 rewardPerStep);

    /// @notice `node` joined run `runId`; it may sign from step `fromStep`.
    event MemberJoined(uint256 indexed runId, address indexed node, uint64 fromStep);

    /// @notice `node` left run `runId`; `lastStep` was the head when it left.
    event MemberLeft(uint256 indexed runId, address indexed node, uint64 lastStep);


    /// @notice Run `runId`'s creator ended it.
    event RunEnded(uint256 indexed runId, uint64 endedAt);


    /// @notice Creates a training run from `spec`, funds its pool with `msg.value`, and
    /// returns its id (ids start at 1).
    /// @dev Emits {RunCreated}, {RunTermsSet} and, with a value, the registry's {PoolFunded}.
    /// `challengeWindow`, `arbiters` and `quorum` are stored for challenges and finality.
    /// (Before issue 35 createRun took the first eleven fields as parameters.)
    ///
    /// Requirements:
    ///
    /// - `replicas` is 1 to 256 and `stages` greater than zero;
    /// - `minReplicas`, the fewest replicas a step may have, is 1 to `replicas`;
    /// - `nodes` has no duplicates, and is not empty for a `Closed` run;
    /// - `quorum` is at most the number of `arbiters`, and zero only when there are none;
    /// - `arbiters` has no duplicates and no zero address;
    /// - `challengeWindow` is below the registry's unbonding delay;
    /// - `genesisDigest` is not zero;
    /// - `independence` is an {Independence} value and `admission` an {Admission} value.
    function createRun(RunSpec calldata spec) external payable returns (uint256 runId);

    /// @notice Makes the caller (a node key) a member of run `runId` from the next step; the
    /// registry locks the run's minimum stake of it until {leaveRun}.
    /// @dev Emits a {MemberJoined} event. `expiry` and `admission` (a 65-byte signature) are
    /// read only for an `Approved` run.
    ///
    /// Requirements:
    ///
    /// - the run exists, has not ended, and is not `Closed`;
    /// - the caller is not a member;
    /// - `Approved`: a non-empty admission signed by the run's creator over
    ///   `Admission(runId, caller, expiry)`, with `expiry` not past;
    /// - the caller has at least the run's minimum (and above zero) of free registry stake.
    function joinRun(uint256 runId, uint64 expiry, bytes calldata admission) external;

    /// @notice Ends the caller's membership of run `runId`: it signs no later step. Its
    /// committed steps stay challengeable; the lock on its stake is released (an unbond
    /// then waits the unbonding delay, longer than any challenge window).
    /// @dev Emits a {MemberLeft} event.
    function leaveRun(uint256 runId) external;

    /// @notice Adds `msg.value` to run `runId`'s reward pool (held by the registry). Anyone
    /// may fund a run.
    /// @dev The registry emits a {INodeRegistry-PoolFunded} event.
    function fundRun(uint256 runId) external payable;

    /// @notice Makes the next `witnesses.length` steps of run `runId` final, in order, and
    /// pays each one's reward from the pool. Anyone may call it. Returns the final step.
    /// @dev Emits {StepFinalized} per step, and the registry a {INodeRegistry-StepRewarded}
    /// when the run pays rewards ({INodeRegistry-payStep}: min(rewardPerStep, pool) split
    /// equally over the step's attested slots; a node slashed at or after the step's commit
    /// forfeits its share to the pool).
    ///
    /// Requirements: as {finalize} for each step, and each witness matches its step's record.
    function finalizeSteps(uint256 runId, StepWitness[] calldata witnesses) external returns (uint64 finalized);

    /// @notice Ends run `runId`: no more joins or commits. Only its creator may.
    /// @dev Emits a {RunEnded} event.
    function endRun(uint256 runId) external;

    /// @notice Credits the caller (in the registry, for {INodeRegistry-claim}) its share of
    /// run `runId`'s remaining pool: pool x (its funding / all funding not yet withdrawn).
    /// @dev The registry emits {INodeRegistry-PoolWithdrawn}. Requirements: the run ended at
    /// least the unbonding delay ago, every committed step is final, and the caller funded
    /// the run (or created it and slashes added to the pool).
    function withdrawPool(uint256 runId) external;

    /// @notice Run `runId`'s admission rule, reward per step, and end time (0: running); its
    /// pool is the registry's {INodeRegistry-poolOf}.
    function runTerms(uint256 runId) external view returns (Admission admission, uint128 rewardPerStep, uint64 endedAt);


    /// @notice The EIP-712 digest of `Admission(runId, node, expiry)` in this ledger's domain.
    function admissionDigest(uint256 runId, address node, uint64 expiry) external view returns (bytes32);
}
