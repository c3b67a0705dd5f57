// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

/// @title ITrainingLedger
/// @notice The on-chain lineage of DiLoCoX training runs: one record per outer step, each
/// backed by one EIP-712 attestation per (replica, stage) slot from a staked member node.
/// @dev Digests are the 32-byte sha2-256 digests of CIDs (DESIGN.md section 4): the
/// checkpoint manifest (dag-cbor) and each contribution (UnixFS file).
interface ITrainingLedger {
    /// @notice One node's signed statement about the work of its (replica, stage) slot.
    /// @param replica The data-parallel replica index, below the run's `replicas`.
    /// @param stage The pipeline stage index, below the run's `stages`.
    /// @param contribution Digest of the compressed contribution the node produced.
    /// @param dataShard Digest of the data shard the node trained on.
    /// @param codeHash Hash of the trainer source that ran.
    /// @param lossMicros The node's training loss times 1e6.
    /// @param signature EIP-712 signature over `Contribution(...)` by the node key.
    struct Attestation {
        uint32 replica;
        uint32 stage;
        bytes32 contribution;
        bytes32 dataShard;
        bytes32 codeHash;
        int64 lossMicros;
        bytes signature;
    }

    /// @notice No run has id `runId`.
    error LedgerUnknownRun(uint256 runId);

    /// @notice A run needs at least one replica and one stage.
    error LedgerInvalidShape(uint32 replicas, uint32 stages);

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

    /// @notice The number of attestations is not replicas * stages.
    error LedgerWrongAttestationCount(uint256 expected, uint256 got);

    /// @notice Attestation `index` is not for slot `index` (slot = replica * stages + stage).
    error LedgerSlotOutOfOrder(uint256 index, uint32 replica, uint32 stage);

    /// @notice The attestation was signed by `node`, which is not a member of the run.
    error LedgerNotMember(uint256 runId, address node);

    /// @notice `node` stakes `stake` wei, below the `required` amount.
    error LedgerInsufficientStake(address node, uint256 stake, uint256 required);

    /// @notice The contributions root does not hash the attested contributions.
    error LedgerContributionsRootMismatch(bytes32 expected, bytes32 got);

    /// @notice Run `runId` was created; its head is `genesisDigest` at step 0.
    event RunCreated(
        uint256 indexed runId,
        address indexed creator,
        bytes32 configDigest,
        bytes32 genesisDigest,
        uint32 replicas,
        uint32 stages,
        address[] nodes
    );

    /// @notice Outer step `step` of run `runId` moved the head from `parent` to `checkpoint`.
    event StepCommitted(
        uint256 indexed runId,
        uint64 indexed step,
        bytes32 indexed checkpoint,
        bytes32 parent,
        bytes32 contributionsRoot,
        bytes32 metricsDigest,
        address submitter
    );

    /// @notice `node` attested its contribution to slot (`replica`, `stage`) of step `step`.
    event ContributionAttested(
        uint256 indexed runId,
        uint64 indexed step,
        address indexed node,
        uint32 replica,
        uint32 stage,
        bytes32 contribution,
        bytes32 dataShard,
        bytes32 codeHash,
        int64 lossMicros
    );

    /// @notice Creates a training run and returns its id (ids start at 1).
    /// @dev Emits a {RunCreated} event. `challengeWindow`, `arbiters` and `quorum` are stored
    /// for challenges and finality.
    ///
    /// Requirements:
    ///
    /// - `replicas` and `stages` are greater than zero;
    /// - `nodes` is not empty and has no duplicates;
    /// - `quorum` is at most the number of `arbiters`, and zero only when there are none;
    /// - `genesisDigest` is not zero.
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
    ) external returns (uint256 runId);

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
    /// - there are replicas * stages attestations, attestation i for slot i
    ///   (slot = replica * stages + stage);
    /// - each attestation is signed over (`runId`, `step`, `parent`, its fields) by a member
    ///   of the run whose registry stake is at least the run's minimum and above zero;
    /// - `contributionsRoot` is keccak256 of the contributions concatenated in slot order.
    function commitStep(
        uint256 runId,
        uint64 step,
        bytes32 parent,
        bytes32 checkpoint,
        bytes32 contributionsRoot,
        bytes32 metricsDigest,
        Attestation[] calldata attestations
    ) external;

    /// @notice The EIP-712 type hash of `Contribution`.
    // solhint-disable-next-line func-name-mixedcase
    function CONTRIBUTION_TYPEHASH() external view returns (bytes32);

    /// @notice The registry whose stakes back attestations.
    function registry() external view returns (address);

    /// @notice The number of runs created so far (also the latest run id).
    function runCount() external view returns (uint256);

    /// @notice The head checkpoint of run `runId` and its step.
    /// @dev Requirements: run `runId` exists.
    function runHead(uint256 runId) external view returns (bytes32 head, uint64 step);

    /// @notice The checkpoint committed at `step` of run `runId` (step 0 is the genesis), or
    /// zero for a step not committed yet.
    /// @dev Requirements: run `runId` exists.
    function stepCheckpoint(uint256 runId, uint64 step) external view returns (bytes32);

    /// @notice Whether `node` is a member of run `runId` (false for an unknown run).
    function isMember(uint256 runId, address node) external view returns (bool);

    /// @notice The EIP-712 digest a node signs for one contribution, for off-chain checks.
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
    ) external view returns (bytes32);
}
