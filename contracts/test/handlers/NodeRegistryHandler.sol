// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {CommonBase} from "forge-std/Base.sol";
import {StdUtils} from "forge-std/StdUtils.sol";

import {NodeRegistry} from "../../src/NodeRegistry.sol";

/// @notice Drives a NodeRegistry through valid register/stake calls from a fixed set of
/// actors, keeping ghost totals for the invariants.
contract NodeRegistryHandler is CommonBase, StdUtils {
    NodeRegistry internal immutable _registry;
    address[] internal _actors;

    uint256 public ghost_totalStaked;

    constructor(NodeRegistry registry_) {
        _registry = registry_;
        for (uint256 i = 0; i < 5; ++i) {
            _actors.push(vm.addr(0x1000 + i));
        }
    }

    function actors() external view returns (address[] memory) {
        return _actors;
    }

    function register(uint256 actorSeed) external {
        address actor = _actors[bound(actorSeed, 0, _actors.length - 1)];
        if (_registry.isRegistered(actor)) return;
        vm.prank(actor);
        _registry.register();
    }

    function stake(uint256 actorSeed, uint256 amount) external {
        address actor = _actors[bound(actorSeed, 0, _actors.length - 1)];
        if (!_registry.isRegistered(actor)) return;
        amount = bound(amount, 1, 1_000 ether);
        vm.deal(actor, amount);
        vm.prank(actor);
        _registry.stake{value: amount}();
        ghost_totalStaked += amount;
    }
}
