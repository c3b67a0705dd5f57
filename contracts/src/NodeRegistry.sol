// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ReentrancyGuard} from "@openzeppelin/contracts/utils/ReentrancyGuard.sol";

import {INodeRegistry} from "./interfaces/INodeRegistry.sol";

/// @title NodeRegistry
/// @notice Registers node keys for their operators, holds the native ETH they stake, escrows
/// challenge bonds, and pays everything out as pull payments.
/// @dev ETH enters only through {stake} and {holdBond} (there is no receive or fallback
/// function, and {depositPool} from the ledger) and leaves only through {withdraw} and
/// {claim}, so `address(this).balance == totalStaked + totalBonds + totalCredits + totalPools`
/// at all times (forced
/// ETH from `selfdestruct` aside, which can only make the balance larger).
///
/// Why unbonding cannot outrun a challenge: {unbond} moves the whole active stake out, and
/// the ledger only counts active stake, so an unbonding node cannot attest any more. Every
/// step it attested was committed before {unbond}, and every run's challenge window is
/// shorter than {unbondingDelay}, so by the time {withdraw} is allowed no such step is
/// challengeable; a challenge opened in time holds the withdrawal until it is resolved.
contract NodeRegistry is INodeRegistry, ReentrancyGuard {
    /// @dev What the registry knows about one node key. The first four fields share a slot;
    /// `stake` has its own, so the ledger's per-attestation {stakeOf} is one storage read.
    struct Node {
        address operator;
        uint64 releaseAt;
        uint32 openChallenges;
        uint256 stake;
        uint256 unbonding;
        uint192 locked;
        uint64 slashedAt;
    }

    /// @dev A run's reward pool: what is in it, the funding not yet withdrawn, and each
    /// funder's part of that.
    struct Pool {
        uint256 balance;
        uint256 funded;
        mapping(address funder => uint256) fundedBy;
    }

    uint256 private constant _BPS = 10_000;

    address private immutable _deployer;
    address private immutable _treasury;
    uint256 private immutable _reporterShareBps;
    uint64 private immutable _unbondingDelay;

    address private _ledger;
    uint64 private _stakeDecreases;
    uint256 private _totalStaked;
    uint256 private _totalBonds;
    uint256 private _totalCredits;
    uint256 private _totalPools;
    mapping(address node => Node) private _nodes;
    mapping(address account => uint256) private _credits;
    mapping(uint256 runId => Pool) private _pools;

    /// @param treasury_ Kept for the deployment ABI; since issue 35 the non-reporter share of
    /// a slash goes to the run's pool, and the treasury receives nothing.
    /// @param reporterShareBps_ The reporter's share of a slash, in basis points (at most 10,000).
    /// @param unbondingDelay_ Seconds from {unbond} to {withdraw}; the ledger keeps every
    /// challenge window below it.
    constructor(address treasury_, uint256 reporterShareBps_, uint64 unbondingDelay_) {
        if (treasury_ == address(0)) revert RegistryZeroAddress();
        if (reporterShareBps_ > _BPS) revert RegistryInvalidShare(reporterShareBps_);
        if (unbondingDelay_ == 0) revert RegistryZeroDelay();
        _deployer = msg.sender;
        _treasury = treasury_;
        _reporterShareBps = reporterShareBps_;
        _unbondingDelay = unbondingDelay_;
    }

    modifier onlyLedger() {
        if (msg.sender != _ledger || msg.sender == address(0)) revert RegistryNotLedger(msg.sender);
        _;
    }

    modifier onlyOperator(address node) {
        if (_nodes[node].operator != msg.sender || msg.sender == address(0)) {
            revert RegistryNotOperator(node, msg.sender);
        }
        _;
    }

    /// @inheritdoc INodeRegistry
    function bindLedger(address ledger_) external {
        if (msg.sender != _deployer) revert RegistryNotDeployer(msg.sender);
        if (_ledger != address(0)) revert RegistryLedgerAlreadyBound(_ledger);
        if (ledger_ == address(0)) revert RegistryZeroAddress();
        _ledger = ledger_;
        emit LedgerBound(ledger_);
    }

    /// @inheritdoc INodeRegistry
    function register(address operator) external {
        Node storage node = _nodes[msg.sender];
        if (node.operator != address(0)) revert RegistryAlreadyRegistered(msg.sender);
        if (operator == address(0)) revert RegistryZeroAddress();

        node.operator = operator;
        emit NodeRegistered(msg.sender, operator);
    }

    /// @inheritdoc INodeRegistry
    function stake(address nodeKey) external payable {
        Node storage node = _nodes[nodeKey];
        if (node.operator == address(0)) revert RegistryNotRegistered(nodeKey);
        if (node.releaseAt != 0) revert RegistryUnbonding(nodeKey, node.releaseAt);
        if (msg.value == 0) revert RegistryZeroAmount();

        uint256 total = node.stake + msg.value;
        node.stake = total;
        _totalStaked += msg.value;
        emit Staked(nodeKey, msg.sender, msg.value, total);
    }

    /// @inheritdoc INodeRegistry
    function unbond(address nodeKey) external onlyOperator(nodeKey) {
        Node storage node = _nodes[nodeKey];
        if (node.releaseAt != 0) revert RegistryUnbonding(nodeKey, node.releaseAt);
        uint256 amount = node.stake;
        if (amount == 0) revert RegistryNothingToUnbond(nodeKey);
        if (node.locked != 0) revert RegistryStakeLocked(nodeKey, node.locked);

        uint64 releaseAt = uint64(block.timestamp) + _unbondingDelay;
        node.stake = 0;
        node.unbonding = amount;
        node.releaseAt = releaseAt;
        _stakeDecreases += 1;
        emit UnbondingStarted(nodeKey, amount, releaseAt);
    }

    /// @inheritdoc INodeRegistry
    function withdraw(address nodeKey) external nonReentrant onlyOperator(nodeKey) {
        Node storage node = _nodes[nodeKey];
        uint64 releaseAt = node.releaseAt;
        if (releaseAt == 0) revert RegistryNotUnbonding(nodeKey);
        // slither-disable-next-line timestamp -- the delay is days long; miners move time by seconds.
        if (block.timestamp < releaseAt) revert RegistryUnbondingNotDue(nodeKey, releaseAt, uint64(block.timestamp));
        if (node.openChallenges != 0) revert RegistryUnderChallenge(nodeKey, node.openChallenges);

        uint256 amount = node.unbonding;
        node.unbonding = 0;
        node.releaseAt = 0;
        _totalStaked -= amount;
        emit Withdrawn(nodeKey, msg.sender, amount);
        _send(msg.sender, amount);
    }

    /// @inheritdoc INodeRegistry
    function claim() external nonReentrant {
        uint256 amount = _credits[msg.sender];
        if (amount == 0) revert RegistryNothingToClaim(msg.sender);

        _credits[msg.sender] = 0;
        _totalCredits -= amount;
        emit Claimed(msg.sender, amount);
        _send(msg.sender, amount);
    }

    /// @inheritdoc INodeRegistry
    function slash(address nodeKey, address reporter, uint256 runId, address poolFunder)
        external
        onlyLedger
        returns (uint256 amount, uint256 reward)
    {
        Node storage node = _nodes[nodeKey];
        amount = node.stake + node.unbonding;
        reward = amount * _reporterShareBps / _BPS;

        node.stake = 0;
        node.unbonding = 0;
        node.releaseAt = 0;
        node.slashedAt = uint64(block.timestamp);
        _stakeDecreases += 1;
        _totalStaked -= amount;
        emit Slashed(nodeKey, reporter, amount, reward);
        _credit(reporter, reward);
        if (amount != reward) _fund(runId, poolFunder, amount - reward);
    }

    /// @inheritdoc INodeRegistry
    function lockStake(address nodeKey, uint256 amount) external onlyLedger {
        Node storage node = _nodes[nodeKey];
        uint256 locked = node.locked;
        uint256 free = node.stake > locked ? node.stake - locked : 0;
        if (free < amount) revert RegistryInsufficientFreeStake(nodeKey, free, amount);
        locked += amount;
        // casting to 'uint192' is safe because locked <= stake, and all stake is wei in this contract
        // forge-lint: disable-next-line(unsafe-typecast)
        node.locked = uint192(locked);
        emit StakeLocked(nodeKey, amount, locked);
    }

    /// @inheritdoc INodeRegistry
    function unlockStake(address nodeKey, uint256 amount) external onlyLedger {
        Node storage node = _nodes[nodeKey];
        uint256 locked = node.locked;
        locked = locked > amount ? locked - amount : 0;
        // casting to 'uint192' is safe because it is at most the stored uint192
        // forge-lint: disable-next-line(unsafe-typecast)
        node.locked = uint192(locked);
        emit StakeUnlocked(nodeKey, amount, locked);
    }

    /// @inheritdoc INodeRegistry
    function fundPool(uint256 runId, address funder) external payable onlyLedger {
        if (msg.value == 0) revert RegistryZeroAmount();
        _fund(runId, funder, msg.value);
    }

    /// @inheritdoc INodeRegistry
    function payStep(uint256 runId, uint64 step, address[] calldata signers, uint256 reward, uint256 committedAt)
        external
        onlyLedger
        returns (uint256 total)
    {
        Pool storage pool = _pools[runId];
        uint256 balance = pool.balance;
        if (reward > balance) reward = balance;
        uint256 share = reward / signers.length;
        if (share == 0) return 0;
        address[] memory paid = new address[](signers.length);
        for (uint256 i = 0; i < signers.length; ++i) {
            uint64 slashedAt = _nodes[signers[i]].slashedAt;
            if (slashedAt != 0 && slashedAt >= committedAt) continue;
            paid[i] = signers[i];
            total += share;
            _credits[signers[i]] += share;
            emit Credited(signers[i], share);
        }
        pool.balance = balance - total;
        _totalPools -= total;
        _totalCredits += total;
        emit StepRewarded(runId, step, share, paid);
    }

    /// @inheritdoc INodeRegistry
    function withdrawPool(uint256 runId, address funder) external onlyLedger returns (uint256 amount) {
        Pool storage pool = _pools[runId];
        uint256 part = pool.fundedBy[funder];
        if (part == 0) revert RegistryNothingToWithdraw(runId, funder);
        // Pro rata of what is left: the last funder out takes the whole remainder.
        amount = pool.balance * part / pool.funded;
        pool.fundedBy[funder] = 0;
        pool.funded -= part;
        pool.balance -= amount;
        _totalPools -= amount;
        emit PoolWithdrawn(runId, funder, amount);
        _credit(funder, amount);
    }

    /// @inheritdoc INodeRegistry
    function holdBond(address nodeKey) external payable onlyLedger {
        if (msg.value == 0) revert RegistryZeroAmount();
        _nodes[nodeKey].openChallenges += 1;
        _totalBonds += msg.value;
        emit BondHeld(nodeKey, msg.value);
    }

    /// @inheritdoc INodeRegistry
    function releaseBond(address nodeKey, address to, uint256 amount) external onlyLedger {
        // Underflow (a release without a matching hold) reverts with a panic: only a broken
        // ledger could cause it.
        _nodes[nodeKey].openChallenges -= 1;
        _totalBonds -= amount;
        emit BondReleased(nodeKey, to, amount);
        _credit(to, amount);
    }

    /// @inheritdoc INodeRegistry
    function holdNode(address nodeKey) external onlyLedger {
        _nodes[nodeKey].openChallenges += 1;
        emit NodeHeld(nodeKey);
    }

    /// @inheritdoc INodeRegistry
    function releaseNode(address nodeKey) external onlyLedger {
        // Underflow (a release without a matching hold) reverts with a panic, as in releaseBond.
        _nodes[nodeKey].openChallenges -= 1;
        emit NodeReleased(nodeKey);
    }

    /// @inheritdoc INodeRegistry
    function stakeOf(address node) external view returns (uint256) {
        return _nodes[node].stake;
    }

    /// @inheritdoc INodeRegistry
    function stakeDecreases() external view returns (uint64) {
        return _stakeDecreases;
    }

    /// @inheritdoc INodeRegistry
    function stakesOf(address[] calldata nodes) external view returns (uint256[] memory stakes) {
        stakes = new uint256[](nodes.length);
        for (uint256 i = 0; i < nodes.length; ++i) {
            stakes[i] = _nodes[nodes[i]].stake;
        }
    }

    /// @inheritdoc INodeRegistry
    function unbondingOf(address node) external view returns (uint256 amount, uint64 releaseAt) {
        return (_nodes[node].unbonding, _nodes[node].releaseAt);
    }

    /// @inheritdoc INodeRegistry
    function operatorOf(address node) external view returns (address) {
        return _nodes[node].operator;
    }

    /// @inheritdoc INodeRegistry
    function operatorsOf(address[] calldata nodes) external view returns (address[] memory operators) {
        operators = new address[](nodes.length);
        for (uint256 i = 0; i < nodes.length; ++i) {
            operators[i] = _nodes[nodes[i]].operator;
        }
    }

    /// @inheritdoc INodeRegistry
    function isRegistered(address node) external view returns (bool) {
        // slither-disable-next-line timestamp -- false positive: compares an address, not a time.
        return _nodes[node].operator != address(0);
    }

    /// @inheritdoc INodeRegistry
    function openChallengesOf(address node) external view returns (uint256) {
        return _nodes[node].openChallenges;
    }

    /// @inheritdoc INodeRegistry
    function creditOf(address account) external view returns (uint256) {
        return _credits[account];
    }

    /// @inheritdoc INodeRegistry
    function totalStaked() external view returns (uint256) {
        return _totalStaked;
    }

    /// @inheritdoc INodeRegistry
    function lockedOf(address node) external view returns (uint256) {
        return _nodes[node].locked;
    }

    /// @inheritdoc INodeRegistry
    function slashedAtOf(address[] calldata nodes) external view returns (uint64[] memory slashedAt) {
        slashedAt = new uint64[](nodes.length);
        for (uint256 i = 0; i < nodes.length; ++i) {
            slashedAt[i] = _nodes[nodes[i]].slashedAt;
        }
    }

    /// @inheritdoc INodeRegistry
    function poolOf(uint256 runId) external view returns (uint256 pool, uint256 funded) {
        return (_pools[runId].balance, _pools[runId].funded);
    }

    /// @inheritdoc INodeRegistry
    function fundedBy(uint256 runId, address funder) external view returns (uint256) {
        return _pools[runId].fundedBy[funder];
    }

    /// @inheritdoc INodeRegistry
    function totalPools() external view returns (uint256) {
        return _totalPools;
    }

    /// @inheritdoc INodeRegistry
    function totalBonds() external view returns (uint256) {
        return _totalBonds;
    }

    /// @inheritdoc INodeRegistry
    function totalCredits() external view returns (uint256) {
        return _totalCredits;
    }

    /// @inheritdoc INodeRegistry
    function ledger() external view returns (address) {
        return _ledger;
    }

    /// @inheritdoc INodeRegistry
    function treasury() external view returns (address) {
        return _treasury;
    }

    /// @inheritdoc INodeRegistry
    function reporterShareBps() external view returns (uint256) {
        return _reporterShareBps;
    }

    /// @inheritdoc INodeRegistry
    function unbondingDelay() external view returns (uint64) {
        return _unbondingDelay;
    }

    /// @dev Adds `amount` wei (already in this contract) to run `runId`'s pool as `funder`'s.
    function _fund(uint256 runId, address funder, uint256 amount) private {
        Pool storage pool = _pools[runId];
        uint256 balance = pool.balance + amount;
        pool.balance = balance;
        pool.funded += amount;
        pool.fundedBy[funder] += amount;
        _totalPools += amount;
        emit PoolFunded(runId, funder, amount, balance);
    }

    /// @dev Adds `amount` to `account`'s claimable credit (nothing for zero).
    function _credit(address account, uint256 amount) private {
        if (amount == 0) return;
        _credits[account] += amount;
        _totalCredits += amount;
        emit Credited(account, amount);
    }

    /// @dev Sends `amount` wei to `to`, last in every function that pays (checks-effects-
    /// interactions; the callers are also `nonReentrant`).
    function _send(address to, uint256 amount) private {
        // slither-disable-next-line arbitrary-send-eth,low-level-calls -- `to` is the caller, paid its own funds.
        (bool ok,) = to.call{value: amount}("");
        if (!ok) revert RegistryTransferFailed(to, amount);
    }
}
