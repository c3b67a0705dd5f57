// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

/// @title INodeRegistry
/// @notice Node keys of the DiLoCoX ledger and the native ETH they stake.
/// @dev A node key registers itself (the transaction proves possession of the key), then
/// stakes. The ledger reads stakes to decide whose attestations count.
interface INodeRegistry {
    /// @notice `node` is already registered.
    error RegistryAlreadyRegistered(address node);

    /// @notice `node` has not registered.
    error RegistryNotRegistered(address node);

    /// @notice A stake of zero wei was sent.
    error RegistryZeroAmount();

    /// @notice `node` registered its key.
    event NodeRegistered(address indexed node);

    /// @notice `node` staked `amount` wei; its stake is now `total` wei.
    event Staked(address indexed node, uint256 amount, uint256 total);

    /// @notice Registers the caller as a node key.
    /// @dev Emits a {NodeRegistered} event.
    ///
    /// Requirements:
    ///
    /// - the caller is not registered yet.
    function register() external;

    /// @notice Adds the ETH sent to the caller's stake.
    /// @dev Emits a {Staked} event.
    ///
    /// Requirements:
    ///
    /// - the caller is registered;
    /// - `msg.value` is greater than zero.
    function stake() external payable;

    /// @notice The stake of `node` in wei (zero for an unknown node).
    function stakeOf(address node) external view returns (uint256);

    /// @notice Whether `node` has registered.
    function isRegistered(address node) external view returns (bool);
}
