// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {CommonBase} from "forge-std/Base.sol";
import {StdUtils} from "forge-std/StdUtils.sol";

import {NodeRegistry} from "../../src/NodeRegistry.sol";

/// @notice Drives a NodeRegistry through valid calls from a fixed set of node keys and their
/// operators, and plays the bound ledger (slash, bonds). Keeps ghost totals of every wei
/// that entered and left, and of the bonds held.
contract NodeRegistryHandler is CommonBase, StdUtils {
    NodeRegistry internal immutable _registry;
    address[] internal _actors;
    address[] internal _payees;
    /// @dev Bonds held per node, to release only what was held.
    mapping(address node => uint256[]) internal _heldBonds;

    uint256 public ghost_in;
    uint256 public ghost_out;
    uint256 public ghost_bonds;

    constructor(NodeRegistry registry_) {
        _registry = registry_;
        for (uint256 i = 0; i < 5; ++i) {
            _actors.push(vm.addr(0x1000 + i));
            _payees.push(_operator(i));
        }
        _payees.push(_registry.treasury());
    }

    function actors() external view returns (address[] memory) {
        return _actors;
    }

    /// @dev Every account that can hold a credit: the operators and the treasury.
    function payees() external view returns (address[] memory) {
        return _payees;
    }

    function _operator(uint256 i) internal pure returns (address) {
        return vm.addr(0x2000 + i);
    }

    function _pick(uint256 seed) internal view returns (uint256 i, address node) {
        i = bound(seed, 0, _actors.length - 1);
        node = _actors[i];
    }

    function register(uint256 actorSeed) external {
        (uint256 i, address node) = _pick(actorSeed);
        if (_registry.isRegistered(node)) return;
        vm.prank(node);
        _registry.register(_operator(i));
    }

    function stake(uint256 actorSeed, uint256 amount) external {
        (uint256 i, address node) = _pick(actorSeed);
        (, uint64 releaseAt) = _registry.unbondingOf(node);
        if (!_registry.isRegistered(node) || releaseAt != 0) return;
        amount = bound(amount, 1, 1_000 ether);
        vm.deal(_operator(i), amount);
        vm.prank(_operator(i));
        _registry.stake{value: amount}(node);
        ghost_in += amount;
    }

    function unbond(uint256 actorSeed) external {
        (uint256 i, address node) = _pick(actorSeed);
        (, uint64 releaseAt) = _registry.unbondingOf(node);
        if (releaseAt != 0 || _registry.stakeOf(node) == 0) return;
        vm.prank(_operator(i));
        _registry.unbond(node);
    }

    function withdraw(uint256 actorSeed) external {
        (uint256 i, address node) = _pick(actorSeed);
        (uint256 amount, uint64 releaseAt) = _registry.unbondingOf(node);
        if (releaseAt == 0 || _registry.openChallengesOf(node) != 0) return;
        if (block.timestamp < releaseAt) vm.warp(releaseAt);
        vm.prank(_operator(i));
        _registry.withdraw(node);
        ghost_out += amount;
    }

    function slash(uint256 actorSeed, uint256 reporterSeed) external {
        (, address node) = _pick(actorSeed);
        (uint256 j,) = _pick(reporterSeed);
        _registry.slash(node, _operator(j), 1, address(this));
    }

    function holdBond(uint256 actorSeed, uint256 amount) external {
        (, address node) = _pick(actorSeed);
        amount = bound(amount, 1, 100 ether);
        vm.deal(address(this), amount);
        _registry.holdBond{value: amount}(node);
        _heldBonds[node].push(amount);
        ghost_in += amount;
        ghost_bonds += amount;
    }

    function releaseBond(uint256 actorSeed, uint256 payeeSeed) external {
        (, address node) = _pick(actorSeed);
        uint256[] storage held = _heldBonds[node];
        if (held.length == 0) return;
        uint256 amount = held[held.length - 1];
        held.pop();
        (uint256 j,) = _pick(payeeSeed);
        _registry.releaseBond(node, _operator(j), amount);
        ghost_bonds -= amount;
    }

    function claim(uint256 payeeSeed) external {
        address payee = _payees[bound(payeeSeed, 0, _payees.length - 1)];
        uint256 amount = _registry.creditOf(payee);
        if (amount == 0) return;
        vm.prank(payee);
        _registry.claim();
        ghost_out += amount;
    }

    function warp(uint256 seconds_) external {
        vm.warp(block.timestamp + bound(seconds_, 1, 2 days));
    }
}
