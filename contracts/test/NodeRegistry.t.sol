// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Test} from "forge-std/Test.sol";

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {INodeRegistry} from "../src/interfaces/INodeRegistry.sol";
import {NodeRegistryHandler} from "./handlers/NodeRegistryHandler.sol";

contract NodeRegistryTest is Test {
    NodeRegistry internal registry;
    address internal node = makeAddr("node");
    address internal stranger = makeAddr("stranger");

    function setUp() public {
        registry = new NodeRegistry();
        vm.deal(node, 100 ether);
        vm.deal(stranger, 100 ether);
    }

    function _registered() internal {
        vm.prank(node);
        registry.register();
    }

    // ---------------------------------------------------------------- register

    function test_register_marksCallerRegistered_andEmitsNodeRegistered() public {
        vm.expectEmit(address(registry));
        emit INodeRegistry.NodeRegistered(node);
        vm.prank(node);
        registry.register();

        assertTrue(registry.isRegistered(node));
        assertFalse(registry.isRegistered(stranger));
        assertEq(registry.stakeOf(node), 0);
    }

    function test_register_revertsWith_AlreadyRegistered_whenCalledTwice() public {
        _registered();
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryAlreadyRegistered.selector, node));
        vm.prank(node);
        registry.register();
    }

    // ---------------------------------------------------------------- stake

    function test_stake_addsValueToStake_andEmitsStaked() public {
        _registered();
        vm.expectEmit(address(registry));
        emit INodeRegistry.Staked(node, 1 ether, 1 ether);
        vm.prank(node);
        registry.stake{value: 1 ether}();

        assertEq(registry.stakeOf(node), 1 ether);
        assertEq(address(registry).balance, 1 ether);
    }

    function test_stake_accumulates_overSeveralDeposits() public {
        _registered();
        vm.prank(node);
        registry.stake{value: 1 ether}();

        vm.expectEmit(address(registry));
        emit INodeRegistry.Staked(node, 2 ether, 3 ether);
        vm.prank(node);
        registry.stake{value: 2 ether}();

        assertEq(registry.stakeOf(node), 3 ether);
    }

    function test_stake_revertsWith_NotRegistered_whenCallerIsUnknown() public {
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotRegistered.selector, stranger));
        vm.prank(stranger);
        registry.stake{value: 1 ether}();
    }

    function test_stake_revertsWith_ZeroAmount_whenNoValueIsSent() public {
        _registered();
        vm.expectRevert(INodeRegistry.RegistryZeroAmount.selector);
        vm.prank(node);
        registry.stake();
    }

    function test_stakeOf_isZero_andIsRegisteredFalse_forUnknownNode() public view {
        assertEq(registry.stakeOf(stranger), 0);
        assertFalse(registry.isRegistered(stranger));
    }

    function test_plainTransfer_isRefused_soStakesAlwaysEqualBalance() public {
        vm.prank(stranger);
        (bool ok,) = address(registry).call{value: 1 ether}("");
        assertFalse(ok);
        assertEq(address(registry).balance, 0);
    }

    function testFuzz_stake_totalIsSumOfDeposits(uint256 first, uint256 second) public {
        first = bound(first, 1, 50 ether);
        second = bound(second, 1, 50 ether);
        _registered();

        vm.prank(node);
        registry.stake{value: first}();
        vm.expectEmit(address(registry));
        emit INodeRegistry.Staked(node, second, first + second);
        vm.prank(node);
        registry.stake{value: second}();

        assertEq(registry.stakeOf(node), first + second);
        assertEq(address(registry).balance, first + second);
    }
}

/// Invariant tests: random register/stake sequences from a handful of actors.
contract NodeRegistryInvariantTest is Test {
    NodeRegistry internal registry;
    NodeRegistryHandler internal handler;

    function setUp() public {
        registry = new NodeRegistry();
        handler = new NodeRegistryHandler(registry);
        targetContract(address(handler));
    }

    // The registry's balance equals the sum of all stakes.
    function invariant_balanceEqualsSumOfStakes() public view {
        uint256 sum;
        address[] memory actors = handler.actors();
        for (uint256 i = 0; i < actors.length; ++i) {
            sum += registry.stakeOf(actors[i]);
        }
        assertEq(address(registry).balance, sum);
        assertEq(sum, handler.ghost_totalStaked());
    }

    // Only registered nodes hold stake.
    function invariant_onlyRegisteredNodesHoldStake() public view {
        address[] memory actors = handler.actors();
        for (uint256 i = 0; i < actors.length; ++i) {
            if (!registry.isRegistered(actors[i])) assertEq(registry.stakeOf(actors[i]), 0);
        }
    }
}
