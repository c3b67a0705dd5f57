// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {INodeRegistry} from "./interfaces/INodeRegistry.sol";

/// @title NodeRegistry
/// @notice Registers node keys and holds the native ETH they stake.
/// @dev Stake accounting equals the contract's balance: ETH enters only through {stake}
/// (there is no receive or fallback function). Unbonding, withdrawal and slashing by the
/// ledger extend {Node} and this contract later.
contract NodeRegistry is INodeRegistry {
    /// @dev What the registry knows about one node key.
    struct Node {
        bool registered;
        uint256 stake;
    }

    mapping(address node => Node) private _nodes;

    /// @inheritdoc INodeRegistry
    function register() external {
        Node storage node = _nodes[msg.sender];
        if (node.registered) revert RegistryAlreadyRegistered(msg.sender);

        node.registered = true;
        emit NodeRegistered(msg.sender);
    }

    /// @inheritdoc INodeRegistry
    function stake() external payable {
        Node storage node = _nodes[msg.sender];
        if (!node.registered) revert RegistryNotRegistered(msg.sender);
        if (msg.value == 0) revert RegistryZeroAmount();

        uint256 total = node.stake + msg.value;
        node.stake = total;
        emit Staked(msg.sender, msg.value, total);
    }

    /// @inheritdoc INodeRegistry
    function stakeOf(address node) external view returns (uint256) {
        return _nodes[node].stake;
    }

    /// @inheritdoc INodeRegistry
    function isRegistered(address node) external view returns (bool) {
        return _nodes[node].registered;
    }
}
