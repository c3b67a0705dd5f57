// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Test, stdError} from "forge-std/Test.sol";

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {INodeRegistry} from "../src/interfaces/INodeRegistry.sol";
import {NodeRegistryHandler} from "./handlers/NodeRegistryHandler.sol";

/// @dev An operator contract that tries to re-enter the registry when paid.
contract ReentrantOperator {
    NodeRegistry internal immutable _registry;
    address internal _node;
    bool internal _viaClaim;

    constructor(NodeRegistry registry_) {
        _registry = registry_;
    }

    function attack(address node, bool viaClaim) external {
        _node = node;
        _viaClaim = viaClaim;
        if (viaClaim) _registry.claim();
        else _registry.withdraw(node);
    }

    function unbond(address node) external {
        _registry.unbond(node);
    }

    receive() external payable {
        // Either re-entry reverts with ReentrancyGuardReentrantCall, failing this transfer.
        if (_viaClaim) _registry.claim();
        else _registry.withdraw(_node);
    }
}

/// @dev An operator contract that refuses ETH.
contract RefusingOperator {
    function withdraw(NodeRegistry registry, address node) external {
        registry.withdraw(node);
    }

    function unbond(NodeRegistry registry, address node) external {
        registry.unbond(node);
    }
}

contract NodeRegistryTest is Test {
    uint64 internal constant DELAY = 7 days;
    uint256 internal constant BPS = 2_500;

    NodeRegistry internal registry;
    address internal node = makeAddr("node");
    address internal operator = makeAddr("operator");
    address internal stranger = makeAddr("stranger");
    address internal treasury = makeAddr("treasury");
    address internal reporter = makeAddr("reporter");

    function setUp() public {
        registry = new NodeRegistry(treasury, BPS, DELAY);
        // This test contract plays the ledger.
        registry.bindLedger(address(this));
        vm.deal(operator, 100 ether);
        vm.deal(stranger, 100 ether);
        vm.deal(address(this), 100 ether);
    }

    function _registered() internal {
        vm.prank(node);
        registry.register(operator);
    }

    function _staked(uint256 amount) internal {
        _registered();
        vm.prank(operator);
        registry.stake{value: amount}(node);
    }

    function _unbonding(uint256 amount) internal {
        _staked(amount);
        vm.prank(operator);
        registry.unbond(node);
    }

    function _assertAccounting() internal view {
        assertEq(address(registry).balance, registry.totalStaked() + registry.totalBonds() + registry.totalCredits() + registry.totalPools());
    }

    // ---------------------------------------------------------------- constructor and binding

    function test_constructor_storesParameters() public view {
        assertEq(registry.treasury(), treasury);
        assertEq(registry.reporterShareBps(), BPS);
        assertEq(registry.unbondingDelay(), DELAY);
        assertEq(registry.ledger(), address(this));
    }

    function test_constructor_revertsWith_ZeroAddress_whenTreasuryIsZero() public {
        vm.expectRevert(INodeRegistry.RegistryZeroAddress.selector);
        new NodeRegistry(address(0), BPS, DELAY);
    }

    function test_constructor_revertsWith_InvalidShare_whenShareExceedsAllOfIt() public {
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryInvalidShare.selector, 10_001));
        new NodeRegistry(treasury, 10_001, DELAY);
    }

    function test_constructor_revertsWith_ZeroDelay_whenDelayIsZero() public {
        vm.expectRevert(INodeRegistry.RegistryZeroDelay.selector);
        new NodeRegistry(treasury, BPS, 0);
    }

    function test_bindLedger_setsLedger_andEmitsLedgerBound() public {
        NodeRegistry fresh = new NodeRegistry(treasury, BPS, DELAY);
        vm.expectEmit(address(fresh));
        emit INodeRegistry.LedgerBound(stranger);
        fresh.bindLedger(stranger);
        assertEq(fresh.ledger(), stranger);
    }

    function test_bindLedger_revertsWith_NotDeployer_whenCalledByAnother() public {
        NodeRegistry fresh = new NodeRegistry(treasury, BPS, DELAY);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotDeployer.selector, stranger));
        vm.prank(stranger);
        fresh.bindLedger(stranger);
    }

    function test_bindLedger_revertsWith_LedgerAlreadyBound_whenCalledTwice() public {
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryLedgerAlreadyBound.selector, address(this)));
        registry.bindLedger(stranger);
    }

    function test_bindLedger_revertsWith_ZeroAddress_whenLedgerIsZero() public {
        NodeRegistry fresh = new NodeRegistry(treasury, BPS, DELAY);
        vm.expectRevert(INodeRegistry.RegistryZeroAddress.selector);
        fresh.bindLedger(address(0));
    }

    // ---------------------------------------------------------------- register

    function test_register_recordsOperator_andEmitsNodeRegistered() public {
        vm.expectEmit(address(registry));
        emit INodeRegistry.NodeRegistered(node, operator);
        vm.prank(node);
        registry.register(operator);

        assertTrue(registry.isRegistered(node));
        assertEq(registry.operatorOf(node), operator);
        assertFalse(registry.isRegistered(stranger));
        assertEq(registry.stakeOf(node), 0);
    }

    function test_register_revertsWith_AlreadyRegistered_whenCalledTwice() public {
        _registered();
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryAlreadyRegistered.selector, node));
        vm.prank(node);
        registry.register(stranger);
    }

    function test_register_revertsWith_ZeroAddress_whenOperatorIsZero() public {
        vm.expectRevert(INodeRegistry.RegistryZeroAddress.selector);
        vm.prank(node);
        registry.register(address(0));
    }

    // ---------------------------------------------------------------- stake

    function test_stake_addsValueToStake_andEmitsStaked() public {
        _registered();
        vm.expectEmit(address(registry));
        emit INodeRegistry.Staked(node, operator, 1 ether, 1 ether);
        vm.prank(operator);
        registry.stake{value: 1 ether}(node);

        assertEq(registry.stakeOf(node), 1 ether);
        assertEq(registry.totalStaked(), 1 ether);
        assertEq(address(registry).balance, 1 ether);
    }

    function test_stake_acceptsDepositsFromAnyone_andAccumulates() public {
        _staked(1 ether);
        vm.expectEmit(address(registry));
        emit INodeRegistry.Staked(node, stranger, 2 ether, 3 ether);
        vm.prank(stranger);
        registry.stake{value: 2 ether}(node);
        assertEq(registry.stakeOf(node), 3 ether);
    }

    function test_stake_revertsWith_NotRegistered_whenNodeIsUnknown() public {
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotRegistered.selector, stranger));
        vm.prank(operator);
        registry.stake{value: 1 ether}(stranger);
    }

    function test_stake_revertsWith_ZeroAmount_whenNoValueIsSent() public {
        _registered();
        vm.expectRevert(INodeRegistry.RegistryZeroAmount.selector);
        vm.prank(operator);
        registry.stake(node);
    }

    function test_stake_revertsWith_Unbonding_whenNodeIsUnbonding() public {
        _unbonding(1 ether);
        uint64 releaseAt = uint64(block.timestamp) + DELAY;
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryUnbonding.selector, node, releaseAt));
        vm.prank(operator);
        registry.stake{value: 1 ether}(node);
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
        _staked(first);
        vm.expectEmit(address(registry));
        emit INodeRegistry.Staked(node, operator, second, first + second);
        vm.prank(operator);
        registry.stake{value: second}(node);

        assertEq(registry.stakeOf(node), first + second);
        assertEq(address(registry).balance, first + second);
    }

    // ---------------------------------------------------------------- unbond

    function test_unbond_movesAllStakeToUnbonding_andEmitsUnbondingStarted() public {
        _staked(3 ether);
        uint64 releaseAt = uint64(block.timestamp) + DELAY;
        vm.expectEmit(address(registry));
        emit INodeRegistry.UnbondingStarted(node, 3 ether, releaseAt);
        vm.prank(operator);
        registry.unbond(node);

        assertEq(registry.stakeOf(node), 0);
        (uint256 amount, uint64 at) = registry.unbondingOf(node);
        assertEq(amount, 3 ether);
        assertEq(at, releaseAt);
        assertEq(registry.totalStaked(), 3 ether);
        _assertAccounting();
    }

    function test_unbond_revertsWith_NotOperator_whenCalledByTheNodeKey() public {
        _staked(1 ether);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotOperator.selector, node, node));
        vm.prank(node);
        registry.unbond(node);
    }

    function test_unbond_revertsWith_NotOperator_forAnUnknownNode() public {
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotOperator.selector, stranger, operator));
        vm.prank(operator);
        registry.unbond(stranger);
    }

    function test_unbond_revertsWith_Unbonding_whenAlreadyUnbonding() public {
        _unbonding(1 ether);
        vm.expectRevert(
            abi.encodeWithSelector(INodeRegistry.RegistryUnbonding.selector, node, uint64(block.timestamp) + DELAY)
        );
        vm.prank(operator);
        registry.unbond(node);
    }

    function test_unbond_revertsWith_NothingToUnbond_whenNodeHasNoStake() public {
        _registered();
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNothingToUnbond.selector, node));
        vm.prank(operator);
        registry.unbond(node);
    }

    // ---------------------------------------------------------------- withdraw

    function test_withdraw_paysOperator_afterTheDelay_andEmitsWithdrawn() public {
        _unbonding(2 ether);
        vm.warp(block.timestamp + DELAY);
        uint256 before = operator.balance;
        vm.expectEmit(address(registry));
        emit INodeRegistry.Withdrawn(node, operator, 2 ether);
        vm.prank(operator);
        registry.withdraw(node);

        assertEq(operator.balance, before + 2 ether);
        (uint256 amount, uint64 at) = registry.unbondingOf(node);
        assertEq(amount, 0);
        assertEq(at, 0);
        assertEq(address(registry).balance, 0);
        _assertAccounting();
    }

    function test_withdraw_letsTheNodeStakeAgain() public {
        _unbonding(1 ether);
        vm.warp(block.timestamp + DELAY);
        vm.startPrank(operator);
        registry.withdraw(node);
        registry.stake{value: 1 ether}(node);
        vm.stopPrank();
        assertEq(registry.stakeOf(node), 1 ether);
    }

    function test_withdraw_revertsWith_UnbondingNotDue_beforeTheDelay() public {
        _unbonding(1 ether);
        uint64 releaseAt = uint64(block.timestamp) + DELAY;
        vm.warp(releaseAt - 1);
        vm.expectRevert(
            abi.encodeWithSelector(INodeRegistry.RegistryUnbondingNotDue.selector, node, releaseAt, releaseAt - 1)
        );
        vm.prank(operator);
        registry.withdraw(node);
    }

    function test_withdraw_revertsWith_NotUnbonding_whenNodeDidNotUnbond() public {
        _staked(1 ether);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotUnbonding.selector, node));
        vm.prank(operator);
        registry.withdraw(node);
    }

    function test_withdraw_revertsWith_NotOperator_whenCalledByAStranger() public {
        _unbonding(1 ether);
        vm.warp(block.timestamp + DELAY);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotOperator.selector, node, stranger));
        vm.prank(stranger);
        registry.withdraw(node);
    }

    function test_withdraw_revertsWith_UnderChallenge_whileABondIsHeldAgainstTheNode() public {
        _unbonding(1 ether);
        registry.holdBond{value: 1 ether}(node);
        vm.warp(block.timestamp + DELAY);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryUnderChallenge.selector, node, 1));
        vm.prank(operator);
        registry.withdraw(node);

        registry.releaseBond(node, stranger, 1 ether);
        vm.prank(operator);
        registry.withdraw(node);
        _assertAccounting();
    }

    function test_withdraw_revertsWith_TransferFailed_whenOperatorRefusesEth() public {
        RefusingOperator refusing = new RefusingOperator();
        vm.prank(node);
        registry.register(address(refusing));
        registry.stake{value: 1 ether}(node);
        refusing.unbond(registry, node);
        vm.warp(block.timestamp + DELAY);
        vm.expectRevert(
            abi.encodeWithSelector(INodeRegistry.RegistryTransferFailed.selector, address(refusing), 1 ether)
        );
        refusing.withdraw(registry, node);
    }

    function test_withdraw_cannotBeReentered() public {
        ReentrantOperator attacker = new ReentrantOperator(registry);
        vm.prank(node);
        registry.register(address(attacker));
        registry.stake{value: 1 ether}(node);
        attacker.unbond(node);
        vm.warp(block.timestamp + DELAY);
        // The re-entrant call reverts inside receive(), so the payment fails as a whole.
        vm.expectRevert(
            abi.encodeWithSelector(INodeRegistry.RegistryTransferFailed.selector, address(attacker), 1 ether)
        );
        attacker.attack(node, false);
        assertEq(address(registry).balance, 1 ether);
    }

    function testFuzz_withdraw_opensExactlyAtReleaseTime(uint256 amount, uint64 wait) public {
        amount = bound(amount, 1, 50 ether);
        wait = uint64(bound(wait, 0, 2 * uint256(DELAY)));
        _unbonding(amount);
        // vm.getBlockTimestamp, not block.timestamp: the IR pipeline may read the latter once
        // per call frame, before the warp.
        uint256 start = vm.getBlockTimestamp();
        vm.warp(start + wait);
        if (wait < DELAY) {
            vm.expectRevert(
                abi.encodeWithSelector(
                    INodeRegistry.RegistryUnbondingNotDue.selector, node, uint64(start) + DELAY, uint64(start + wait)
                )
            );
        }
        vm.prank(operator);
        registry.withdraw(node);
        _assertAccounting();
    }

    // ---------------------------------------------------------------- slash, bonds, credits

    function test_slash_takesActiveAndUnbondingStake_andSplitsItBetweenReporterAndPools() public {
        _unbonding(4 ether);
        vm.expectEmit(address(registry));
        emit INodeRegistry.Slashed(node, reporter, 4 ether, 1 ether);
        (uint256 amount, uint256 reward) = registry.slash(node, reporter, 1, address(this));

        assertEq(amount, 4 ether);
        assertEq(reward, 1 ether);
        assertEq(registry.creditOf(reporter), 1 ether);
        assertEq(registry.totalPools(), 3 ether);
        assertEq(registry.creditOf(treasury), 0);
        assertEq(registry.totalStaked(), 0);
        (uint256 unbonding, uint64 releaseAt) = registry.unbondingOf(node);
        assertEq(unbonding, 0);
        assertEq(releaseAt, 0);
        _assertAccounting();
    }

    function test_slash_ofANodeWithoutStake_takesNothing() public {
        _registered();
        (uint256 amount, uint256 reward) = registry.slash(node, reporter, 1, address(this));
        assertEq(amount, 0);
        assertEq(reward, 0);
        assertEq(registry.totalCredits(), 0);
    }

    function test_slash_revertsWith_NotLedger_whenCalledByAnother() public {
        _staked(1 ether);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotLedger.selector, stranger));
        vm.prank(stranger);
        registry.slash(node, stranger, 1, address(this));
    }

    function test_holdBond_revertsWith_NotLedger_whenCalledByAnother() public {
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotLedger.selector, stranger));
        vm.prank(stranger);
        registry.holdBond{value: 1 ether}(node);
    }

    function test_holdBond_revertsWith_ZeroAmount_whenNoValueIsSent() public {
        vm.expectRevert(INodeRegistry.RegistryZeroAmount.selector);
        registry.holdBond(node);
    }

    function test_releaseBond_revertsWith_NotLedger_whenCalledByAnother() public {
        registry.holdBond{value: 1 ether}(node);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotLedger.selector, stranger));
        vm.prank(stranger);
        registry.releaseBond(node, stranger, 1 ether);
    }

    function test_holdBond_thenReleaseBond_movesTheBondIntoACredit() public {
        vm.expectEmit(address(registry));
        emit INodeRegistry.BondHeld(node, 1 ether);
        registry.holdBond{value: 1 ether}(node);
        assertEq(registry.totalBonds(), 1 ether);
        assertEq(registry.openChallengesOf(node), 1);

        vm.expectEmit(address(registry));
        emit INodeRegistry.BondReleased(node, reporter, 1 ether);
        vm.expectEmit(address(registry));
        emit INodeRegistry.Credited(reporter, 1 ether);
        registry.releaseBond(node, reporter, 1 ether);
        assertEq(registry.totalBonds(), 0);
        assertEq(registry.openChallengesOf(node), 0);
        assertEq(registry.creditOf(reporter), 1 ether);
        _assertAccounting();
    }

    function test_holdNode_thenReleaseNode_holdsTheWithdrawalWithoutABond() public {
        vm.expectEmit(address(registry));
        emit INodeRegistry.NodeHeld(node);
        registry.holdNode(node);
        assertEq(registry.openChallengesOf(node), 1);
        assertEq(registry.totalBonds(), 0);
        vm.expectEmit(address(registry));
        emit INodeRegistry.NodeReleased(node);
        registry.releaseNode(node);
        assertEq(registry.openChallengesOf(node), 0);
        _assertAccounting();
    }

    function test_holdNode_revertsWith_NotLedger_whenCalledByAnother() public {
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotLedger.selector, stranger));
        vm.prank(stranger);
        registry.holdNode(node);
    }

    function test_releaseNode_revertsWith_NotLedger_whenCalledByAnother() public {
        registry.holdNode(node);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotLedger.selector, stranger));
        vm.prank(stranger);
        registry.releaseNode(node);
    }

    function test_releaseNode_panics_withoutAHold() public {
        vm.expectRevert(stdError.arithmeticError);
        registry.releaseNode(node);
    }

    function test_operatorsOf_givesEachNodesOperator_andZeroForAnUnknownNode() public {
        address[] memory keys = new address[](2);
        (keys[0], keys[1]) = (node, stranger);
        address[] memory operators = registry.operatorsOf(keys);
        assertEq(operators[0], registry.operatorOf(node));
        assertEq(operators[1], address(0));
    }

    function test_claim_paysTheCredit_andEmitsClaimed() public {
        _staked(2 ether);
        registry.slash(node, reporter, 1, address(this));
        uint256 before = reporter.balance;
        vm.expectEmit(address(registry));
        emit INodeRegistry.Claimed(reporter, 0.5 ether);
        vm.prank(reporter);
        registry.claim();
        assertEq(reporter.balance, before + 0.5 ether);
        assertEq(registry.creditOf(reporter), 0);
        _assertAccounting();
    }

    function test_claim_revertsWith_NothingToClaim_whenThereIsNoCredit() public {
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNothingToClaim.selector, stranger));
        vm.prank(stranger);
        registry.claim();
    }

    function test_claim_cannotBeReentered() public {
        ReentrantOperator attacker = new ReentrantOperator(registry);
        _staked(2 ether);
        registry.slash(node, address(attacker), 1, address(this));
        vm.expectRevert(
            abi.encodeWithSelector(INodeRegistry.RegistryTransferFailed.selector, address(attacker), 0.5 ether)
        );
        attacker.attack(node, true);
        assertEq(registry.creditOf(address(attacker)), 0.5 ether);
    }

    function testFuzz_slash_splitsExactly(uint256 amount, uint256 bps) public {
        amount = bound(amount, 1, 1_000 ether);
        bps = bound(bps, 0, 10_000);
        NodeRegistry fuzzed = new NodeRegistry(treasury, bps, DELAY);
        fuzzed.bindLedger(address(this));
        vm.prank(node);
        fuzzed.register(operator);
        vm.deal(address(this), amount);
        fuzzed.stake{value: amount}(node);

        (uint256 slashed, uint256 reward) = fuzzed.slash(node, reporter, 1, address(this));
        assertEq(slashed, amount);
        assertEq(reward, amount * bps / 10_000);
        assertEq(fuzzed.creditOf(reporter) + fuzzed.totalPools(), amount);
        assertEq(address(fuzzed).balance, fuzzed.totalStaked() + fuzzed.totalBonds() + fuzzed.totalCredits() + fuzzed.totalPools());
    }
}

/// Invariant tests: random register/stake/unbond/withdraw/slash/bond/claim sequences.
contract NodeRegistryInvariantTest is Test {
    NodeRegistry internal registry;
    NodeRegistryHandler internal handler;

    function setUp() public {
        registry = new NodeRegistry(makeAddr("treasury"), 3_000, 1 days);
        handler = new NodeRegistryHandler(registry);
        registry.bindLedger(address(handler));
        targetContract(address(handler));
    }

    // The registry's balance equals the sum of all stakes (active and unbonding), open bonds
    // and unclaimed credits, both as the registry counts them and as the handler does.
    function invariant_balanceEqualsStakesPlusBondsPlusCredits() public view {
        uint256 stakes;
        address[] memory actors = handler.actors();
        for (uint256 i = 0; i < actors.length; ++i) {
            (uint256 unbonding,) = registry.unbondingOf(actors[i]);
            stakes += registry.stakeOf(actors[i]) + unbonding;
        }
        assertEq(stakes, registry.totalStaked());
        assertEq(registry.totalBonds(), handler.ghost_bonds());
        uint256 credits;
        address[] memory payees = handler.payees();
        for (uint256 i = 0; i < payees.length; ++i) {
            credits += registry.creditOf(payees[i]);
        }
        assertEq(credits, registry.totalCredits());
        assertEq(address(registry).balance, stakes + registry.totalBonds() + credits + registry.totalPools());
    }

    // Every wei that came in is either still held or was paid out.
    function invariant_inflowEqualsHoldingsPlusOutflow() public view {
        assertEq(handler.ghost_in(), address(registry).balance + handler.ghost_out());
    }

    // Only registered nodes hold stake.
    function invariant_onlyRegisteredNodesHoldStake() public view {
        address[] memory actors = handler.actors();
        for (uint256 i = 0; i < actors.length; ++i) {
            if (!registry.isRegistered(actors[i])) assertEq(registry.stakeOf(actors[i]), 0);
        }
    }
}
