// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

/// @title INodeRegistry
/// @notice Node keys of the DiLoCoX ledger, the operators they belong to, and the native ETH
/// staked behind them; also the escrow for challenge bonds and the pull-payment account of
/// every reward, refund and slashed share.
/// @dev A node key registers itself (the transaction proves possession of the key) and names
/// its operator. Anyone may add stake to a node; only its operator unbonds and withdraws it.
/// Only the bound ledger slashes and moves bonds. Accounting: the registry's balance always
/// equals {totalStaked} + {totalBonds} + {totalCredits}.
interface INodeRegistry {
    /// @notice `node` is already registered.
    error RegistryAlreadyRegistered(address node);

    /// @notice `node` has not registered.
    error RegistryNotRegistered(address node);

    /// @notice A zero amount of wei was sent or would be paid.
    error RegistryZeroAmount();

    /// @notice A zero address was given where an account is needed.
    error RegistryZeroAddress();

    /// @notice The reporter share `bps` is above 10,000 basis points.
    error RegistryInvalidShare(uint256 bps);

    /// @notice The unbonding delay is zero.
    error RegistryZeroDelay();

    /// @notice `caller` is not the operator of `node`.
    error RegistryNotOperator(address node, address caller);

    /// @notice `caller` is not the ledger bound to this registry.
    error RegistryNotLedger(address caller);

    /// @notice `caller` is not the account that deployed this registry.
    error RegistryNotDeployer(address caller);

    /// @notice A ledger (`ledger`) is bound already.
    error RegistryLedgerAlreadyBound(address ledger);

    /// @notice `node` is unbonding until `releaseAt`: it can neither stake nor unbond again.
    error RegistryUnbonding(address node, uint64 releaseAt);

    /// @notice `node` has no active stake to unbond.
    error RegistryNothingToUnbond(address node);

    /// @notice `node` is not unbonding.
    error RegistryNotUnbonding(address node);

    /// @notice `node`'s unbonding stake is released at `releaseAt`, after `now`.
    error RegistryUnbondingNotDue(address node, uint64 releaseAt, uint64 now);

    /// @notice `node` has `openChallenges` unresolved challenges: its stake stays put.
    error RegistryUnderChallenge(address node, uint256 openChallenges);

    /// @notice `account` has no credit to claim.
    error RegistryNothingToClaim(address account);

    /// @notice Sending `amount` wei to `to` failed.
    error RegistryTransferFailed(address to, uint256 amount);

    /// @notice The ledger `ledger` was bound to this registry.
    event LedgerBound(address indexed ledger);

    /// @notice `node` registered its key for `operator`.
    event NodeRegistered(address indexed node, address indexed operator);

    /// @notice `from` staked `amount` wei behind `node`; its active stake is now `total` wei.
    event Staked(address indexed node, address indexed from, uint256 amount, uint256 total);

    /// @notice `node` stopped attesting: `amount` wei unbond and can be withdrawn at `releaseAt`.
    event UnbondingStarted(address indexed node, uint256 amount, uint64 releaseAt);

    /// @notice The unbonded `amount` wei of `node` were paid to its `operator`.
    event Withdrawn(address indexed node, address indexed operator, uint256 amount);

    /// @notice `node` lost `amount` wei; `reward` went to `reporter`, the rest to the treasury.
    event Slashed(address indexed node, address indexed reporter, uint256 amount, uint256 reward);

    /// @notice A challenge bond of `amount` wei against `node` is held in escrow.
    event BondHeld(address indexed node, uint256 amount);

    /// @notice A challenge bond of `amount` wei against `node` was released to `to`.
    event BondReleased(address indexed node, address indexed to, uint256 amount);

    /// @notice `node` answers for a challenge whose bond is held against another node (an
    /// aggregate challenge holds every co-signer): its withdrawal waits for the challenge.
    event NodeHeld(address indexed node);

    /// @notice The challenge that {NodeHeld} `node` is resolved.
    event NodeReleased(address indexed node);

    /// @notice `amount` wei were credited to `account`, claimable with {claim}.
    event Credited(address indexed account, uint256 amount);

    /// @notice `account` claimed its `amount` wei of credit.
    event Claimed(address indexed account, uint256 amount);

    /// @notice Binds the ledger that may slash and move bonds; once, by the deployer.
    /// @dev Emits a {LedgerBound} event.
    ///
    /// Requirements:
    ///
    /// - the caller deployed this registry;
    /// - no ledger is bound yet;
    /// - `ledger_` is not the zero address.
    function bindLedger(address ledger_) external;

    /// @notice Registers the caller as a node key owned by `operator`.
    /// @dev Emits a {NodeRegistered} event.
    ///
    /// Requirements:
    ///
    /// - the caller is not registered yet;
    /// - `operator` is not the zero address.
    function register(address operator) external;

    /// @notice Adds the ETH sent to `node`'s active stake.
    /// @dev Emits a {Staked} event.
    ///
    /// Requirements:
    ///
    /// - `node` is registered and not unbonding;
    /// - `msg.value` is greater than zero.
    function stake(address node) external payable;

    /// @notice Moves all of `node`'s active stake into unbonding: the node can no longer
    /// attest, and the stake can be withdrawn after {unbondingDelay}. Unbonding stake can
    /// still be slashed.
    /// @dev Emits an {UnbondingStarted} event.
    ///
    /// Requirements:
    ///
    /// - the caller is `node`'s operator;
    /// - `node` is not unbonding and has active stake.
    function unbond(address node) external;

    /// @notice Pays `node`'s unbonded stake to its operator.
    /// @dev Emits a {Withdrawn} event.
    ///
    /// Requirements:
    ///
    /// - the caller is `node`'s operator;
    /// - `node` is unbonding, its delay has passed and no challenge against it is open.
    function withdraw(address node) external;

    /// @notice Pays the caller its credit (rewards, refunded bonds, the treasury's share).
    /// @dev Emits a {Claimed} event.
    ///
    /// Requirements:
    ///
    /// - the caller has a credit.
    function claim() external;

    /// @notice Takes all of `node`'s stake (active and unbonding): `reporter` is credited
    /// {reporterShareBps} of it, and the rest goes to run `runId`'s pool as `poolFunder`'s
    /// funding (the run's creator; since issue 35 the treasury receives nothing). Returns
    /// the amounts.
    /// @dev Emits a {Slashed} event, and one {Credited} event per non-zero share.
    ///
    /// Requirements:
    ///
    /// - the caller is the bound ledger.
    function slash(address node, address reporter, uint256 runId, address poolFunder)
        external
        returns (uint256 amount, uint256 reward);

    /// @notice Holds `msg.value` as a bond of a challenge against `node`, whose withdrawal
    /// then waits for the challenge to be resolved.
    /// @dev Emits a {BondHeld} event.
    ///
    /// Requirements:
    ///
    /// - the caller is the bound ledger;
    /// - `msg.value` is greater than zero.
    function holdBond(address node) external payable;

    /// @notice Releases a bond of `amount` wei held against `node` as a credit of `to`.
    /// @dev Emits a {BondReleased} and a {Credited} event.
    ///
    /// Requirements:
    ///
    /// - the caller is the bound ledger;
    /// - a bond of at least `amount` wei is held against `node`.
    function releaseBond(address node, address to, uint256 amount) external;

    /// @notice Makes `node`'s withdrawal wait for a challenge it answers for with no bond held
    /// against it (a further co-signer of an aggregate challenge).
    /// @dev Emits a {NodeHeld} event.
    ///
    /// Requirements:
    ///
    /// - the caller is the bound ledger.
    function holdNode(address node) external;

    /// @notice Undoes one {holdNode} of `node`.
    /// @dev Emits a {NodeReleased} event.
    ///
    /// Requirements:
    ///
    /// - the caller is the bound ledger;
    /// - `node` is held.
    function releaseNode(address node) external;

    /// @notice The active stake of `node` in wei: what backs its attestations.
    function stakeOf(address node) external view returns (uint256);

    /// @notice How many times any node's active stake went down (an {unbond} or a slash).
    /// The ledger caches stake checks until it moves.
    function stakeDecreases() external view returns (uint64);

    /// @notice The active stakes of `nodes`, in order (one call for a whole step's signers).
    function stakesOf(address[] calldata nodes) external view returns (uint256[] memory);

    /// @notice The stake `node` is unbonding and when it can be withdrawn (0 when none).
    function unbondingOf(address node) external view returns (uint256 amount, uint64 releaseAt);

    /// @notice The operator of `node` (zero for an unknown node).
    function operatorOf(address node) external view returns (address);

    /// @notice The operators of `nodes`, in order (zero for an unknown node).
    function operatorsOf(address[] calldata nodes) external view returns (address[] memory);

    /// @notice Whether `node` has registered.
    function isRegistered(address node) external view returns (bool);

    /// @notice The number of unresolved challenges against `node`.
    function openChallengesOf(address node) external view returns (uint256);

    /// @notice The wei `account` can {claim}.
    function creditOf(address account) external view returns (uint256);

    /// @notice The sum of all active and unbonding stakes.
    function totalStaked() external view returns (uint256);

    /// @notice The sum of all challenge bonds held.
    function totalBonds() external view returns (uint256);

    /// @notice The sum of all unclaimed credits.
    function totalCredits() external view returns (uint256);

    /// @notice The ledger bound to this registry (zero before {bindLedger}).
    function ledger() external view returns (address);

    /// @notice Where the non-reporter share of slashed stake goes (a treasury or burn address).
    function treasury() external view returns (address);

    /// @notice The reporter's share of a slash, in basis points.
    function reporterShareBps() external view returns (uint256);

    /// @notice Seconds between {unbond} and {withdraw}; longer than any run's challenge window.
    function unbondingDelay() external view returns (uint64);

    // ------------------------------------------------------------ stake locks and pools (issue 35)

    /// @notice `node` has `free` wei of stake not locked by runs; `required` is needed.
    error RegistryInsufficientFreeStake(address node, uint256 free, uint256 required);

    /// @notice `node`'s stake is locked (`locked` wei) by runs it is a member of.
    error RegistryStakeLocked(address node, uint256 locked);

    /// @notice The ledger locked `amount` of `node`'s stake (now `locked` in all).
    event StakeLocked(address indexed node, uint256 amount, uint256 locked);

    /// @notice The ledger released `amount` of `node`'s locked stake (now `locked`).
    event StakeUnlocked(address indexed node, uint256 amount, uint256 locked);

    /// @notice `funder` has nothing of run `runId`'s pool to withdraw.
    error RegistryNothingToWithdraw(uint256 runId, address funder);

    /// @notice `funder` added `amount` wei to run `runId`'s reward pool, now `pool`; a slash's
    /// pool share counts as the run creator's funding.
    event PoolFunded(uint256 indexed runId, address indexed funder, uint256 amount, uint256 pool);

    /// @notice Final step `step` of run `runId` paid `share` wei to each of `paid` (its
    /// signers in slot order; the zero address where a slot's node forfeited its share).
    event StepRewarded(uint256 indexed runId, uint64 indexed step, uint256 share, address[] paid);

    /// @notice `funder` withdrew `amount` wei of run `runId`'s pool, as credit to claim.
    event PoolWithdrawn(uint256 indexed runId, address indexed funder, uint256 amount);

    /// @notice Locks `amount` of `node`'s active stake for a run it joined. Only the ledger.
    /// @dev Emits a {StakeLocked} event. Reverts with {RegistryInsufficientFreeStake} unless
    /// the active stake less what is locked already is at least `amount`.
    function lockStake(address node, uint256 amount) external;

    /// @notice Releases `amount` of `node`'s locked stake (at most what is locked). Only the ledger.
    /// @dev Emits a {StakeUnlocked} event.
    function unlockStake(address node, uint256 amount) external;

    /// @notice Adds `msg.value` to run `runId`'s pool as `funder`'s funding. Only the ledger
    /// (its {ITrainingLedger-fundRun} is open to anyone).
    /// @dev Emits a {PoolFunded} event.
    function fundPool(uint256 runId, address funder) external payable;

    /// @notice Pays final step `step` of run `runId`: min(`reward`, pool) split equally over
    /// its slots (`signers`, in slot order; a node with two slots gets two shares), credited
    /// for {claim}; the division's remainder stays in the pool, and so does the share of a
    /// node slashed at or after `committedAt`. Only the ledger. Returns the total paid.
    /// @dev Emits a {StepRewarded} event and one {Credited} per share paid.
    function payStep(uint256 runId, uint64 step, address[] calldata signers, uint256 reward, uint256 committedAt)
        external
        returns (uint256 total);

    /// @notice Credits `funder` its share of run `runId`'s remaining pool: pool x (its
    /// funding / all funding not yet withdrawn). Only the ledger, which checks the run ended.
    /// @dev Emits a {PoolWithdrawn} and a {Credited} event.
    function withdrawPool(uint256 runId, address funder) external returns (uint256 amount);

    /// @notice Run `runId`'s pool and the funding not yet withdrawn from it.
    function poolOf(uint256 runId) external view returns (uint256 pool, uint256 funded);

    /// @notice Wei of run `runId`'s pool that `funder` put in (or, for the creator, slashes
    /// added) and has not withdrawn.
    function fundedBy(uint256 runId, address funder) external view returns (uint256);

    /// @notice Wei of `node`'s stake locked by runs.
    function lockedOf(address node) external view returns (uint256);

    /// @notice When each of `nodes` was last slashed (block timestamp; 0: never).
    function slashedAtOf(address[] calldata nodes) external view returns (uint64[] memory);

    /// @notice Wei held for the ledger's run pools.
    function totalPools() external view returns (uint256);
}
