// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {INodeRegistry} from "../src/interfaces/INodeRegistry.sol";
import {ITrainingLedger} from "../src/interfaces/ITrainingLedger.sol";
import {NodeRegistry} from "../src/NodeRegistry.sol";
import {LedgerFixture} from "./utils/LedgerFixture.sol";

/// @dev Claims its registry credit, and on receiving the payment tries to claim again.
contract ReentrantClaimer {
    NodeRegistry internal immutable _registry;
    bool public reentered;
    bool public reentryFailed;

    constructor(NodeRegistry registry_) {
        _registry = registry_;
    }

    function claim() external {
        _registry.claim();
    }

    function fund(ITrainingLedger ledger, uint256 runId) external payable {
        ledger.fundRun{value: msg.value}(runId);
    }

    function withdraw(ITrainingLedger ledger, uint256 runId) external {
        ledger.withdrawPool(runId);
    }

    receive() external payable {
        if (reentered) return;
        reentered = true;
        try _registry.claim() {}
        catch {
            reentryFailed = true;
        }
    }
}

/// Open membership (joinRun, leaveRun, admissions), reward pools (fundRun, finalizeSteps,
/// withdrawPool) and where slashed stake goes (issue 35).
contract LedgerRewardsTest is LedgerFixture {
    uint128 internal constant REWARD = 0.4 ether;
    uint256 internal constant FUND = 2 ether;

    address internal newcomer;
    uint256 internal newcomerKey;

    function setUp() public override {
        super.setUp();
        (newcomer, newcomerKey) = makeAddrAndKey("newcomer");
        _registerAndStake("newcomer", MIN_STAKE);
        vm.deal(submitter, 100 ether);
    }

    function _spec(uint8 admission) internal view returns (ITrainingLedger.RunSpec memory spec) {
        spec = ITrainingLedger.RunSpec({
            configDigest: CONFIG,
            genesisDigest: GENESIS,
            nodes: nodes,
            replicas: 2,
            stages: 2,
            minReplicas: 2,
            challengeWindow: WINDOW,
            minStake: MIN_STAKE,
            arbiters: arbiters,
            quorum: 2,
            independence: 0,
            admission: admission,
            rewardPerStep: REWARD
        });
    }

    function _createRewardRun(uint8 admission) internal returns (uint256) {
        vm.prank(submitter);
        return ledger.createRun{value: FUND}(_spec(admission));
    }

    function _witnesses(StepCall memory c) internal view returns (ITrainingLedger.StepWitness[] memory w) {
        w = new ITrainingLedger.StepWitness[](1);
        w[0] = ITrainingLedger.StepWitness({signers: _signersOf(c), shardsRoot: _shardsRoot(c), replicaSet: c.replicaSet});
    }

    function _admission(uint256 key, uint256 runId, address node, uint64 expiry) internal view returns (bytes memory) {
        return _sign(key, ledger.admissionDigest(runId, node, expiry));
    }

    function _assertConservation() internal view {
        assertEq(
            address(registry).balance,
            registry.totalStaked() + registry.totalBonds() + registry.totalCredits() + registry.totalPools()
        );
        assertEq(address(ledger).balance, 0);
    }

    // ---------------------------------------------------------------- createRun(spec)

    function test_createRun_withASpec_storesTheTerms_andFundsThePool() public {
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.RunTermsSet(1, ITrainingLedger.Admission.Open, REWARD);
        uint256 runId = _createRewardRun(1);
        (ITrainingLedger.Admission admission, uint128 reward, uint64 endedAt) = ledger.runTerms(runId);
        (uint256 pool,) = registry.poolOf(runId);
        assertEq(uint8(admission), 1);
        assertEq(reward, REWARD);
        assertEq(pool, FUND);
        assertEq(endedAt, 0);
        assertEq(registry.fundedBy(runId, submitter), FUND);
        assertEq(registry.totalPools(), FUND);
        _assertConservation();
    }

    function test_createRun_withASpec_revertsWith_InvalidAdmission() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidAdmission.selector, 3));
        ledger.createRun(_spec(3));
    }

    function test_createRun_anOpenRun_mayStartWithoutNodes_butAClosedOneMayNot() public {
        ITrainingLedger.RunSpec memory spec = _spec(1);
        spec.nodes = new address[](0);
        ledger.createRun(spec);
        spec.admission = 0;
        vm.expectRevert(ITrainingLedger.LedgerNoNodes.selector);
        ledger.createRun(spec);
    }

    function test_fundRun_byAnyone_growsThePool() public {
        uint256 runId = _createRewardRun(1);
        vm.deal(address(this), 1 ether);
        vm.expectEmit(address(registry));
        emit INodeRegistry.PoolFunded(runId, address(this), 1 ether, FUND + 1 ether);
        ledger.fundRun{value: 1 ether}(runId);
        assertEq(registry.fundedBy(runId, address(this)), 1 ether);
        _assertConservation();
    }

    // ---------------------------------------------------------------- joinRun / leaveRun

    function test_joinRun_revertsWith_RunClosed_forAClosedRun() public {
        uint256 runId = _createRewardRun(0);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerRunClosed.selector, runId));
        vm.prank(newcomer);
        ledger.joinRun(runId, 0, "");
        // The positional createRun makes closed runs too.
        uint256 legacy = _createRun();
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerRunClosed.selector, legacy));
        vm.prank(newcomer);
        ledger.joinRun(legacy, 0, "");
    }

    function test_joinRun_open_makesAMemberFromTheNextStep_andLocksItsStake() public {
        uint256 runId = _createRewardRun(1);
        _commitNext(runId);
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.MemberJoined(runId, newcomer, 2);
        vm.prank(newcomer);
        ledger.joinRun(runId, 0, "");
        assertTrue(ledger.isMember(runId, newcomer));
        assertEq(registry.lockedOf(newcomer), MIN_STAKE);

        // It signs replica 1 stage 1 of step 2.
        StepCall memory c = _nextStep(runId);
        _resign(c, 3, newcomerKey);
        _commit(c);
        assertEq(_signersOf(c)[3], newcomer);

        // The registry holds its stake while it is a member.
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryStakeLocked.selector, newcomer, MIN_STAKE));
        vm.prank(_operatorOf("newcomer"));
        registry.unbond(newcomer);
    }

    function test_joinRun_revertsWith_AlreadyMember() public {
        uint256 runId = _createRewardRun(1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerAlreadyMember.selector, runId, nodes[0]));
        vm.prank(nodes[0]);
        ledger.joinRun(runId, 0, "");
    }

    function test_joinRun_revertsWith_InsufficientFreeStake_withoutEnoughStake() public {
        uint256 runId = _createRewardRun(1);
        address poor = _registerAndStake("poor", MIN_STAKE / 2);
        vm.expectRevert(
            abi.encodeWithSelector(INodeRegistry.RegistryInsufficientFreeStake.selector, poor, MIN_STAKE / 2, MIN_STAKE)
        );
        vm.prank(poor);
        ledger.joinRun(runId, 0, "");
    }

    function test_joinRun_revertsWith_InsufficientFreeStake_whenAnotherRunLocksIt() public {
        uint256 first = _createRewardRun(1);
        uint256 second = _createRewardRun(1);
        vm.prank(newcomer);
        ledger.joinRun(first, 0, "");
        vm.expectRevert(
            abi.encodeWithSelector(INodeRegistry.RegistryInsufficientFreeStake.selector, newcomer, 0, MIN_STAKE)
        );
        vm.prank(newcomer);
        ledger.joinRun(second, 0, "");
    }

    function test_joinRun_approved_revertsWithout_orWithAnExpired_orAForeignAdmission() public {
        uint256 runId = _createRewardRun(2);
        (, uint256 submitterKey) = makeAddrAndKey("submitter");
        uint64 expiry = uint64(block.timestamp + 1 hours);

        vm.startPrank(newcomer);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerAdmissionRequired.selector, runId));
        ledger.joinRun(runId, expiry, "");

        // For another node: it recovers to someone other than the creator.
        bytes memory foreign = _admission(submitterKey, runId, nodes[0], expiry);
        vm.expectPartialRevert(ITrainingLedger.LedgerAdmissionNotByCreator.selector);
        ledger.joinRun(runId, expiry, foreign);

        // Signed by somebody else.
        (, uint256 strangerKey) = makeAddrAndKey("stranger");
        bytes memory forged = _admission(strangerKey, runId, newcomer, expiry);
        vm.expectRevert(
            abi.encodeWithSelector(
                ITrainingLedger.LedgerAdmissionNotByCreator.selector, runId, submitter, makeAddr("stranger")
            )
        );
        ledger.joinRun(runId, expiry, forged);
        vm.stopPrank();

        bytes memory valid = _admission(submitterKey, runId, newcomer, expiry);
        vm.warp(expiry + 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerAdmissionExpired.selector, runId, expiry));
        vm.prank(newcomer);
        ledger.joinRun(runId, expiry, valid);

        vm.warp(expiry);
        vm.prank(newcomer);
        ledger.joinRun(runId, expiry, valid);
        assertTrue(ledger.isMember(runId, newcomer));
    }

    function test_leaveRun_releasesTheLock_andTheNodeSignsNoMore() public {
        uint256 runId = _createRewardRun(1);
        vm.prank(newcomer);
        ledger.joinRun(runId, 0, "");
        StepCall memory c = _nextStep(runId);
        _resign(c, 3, newcomerKey);
        _commit(c);

        vm.expectEmit(address(ledger));
        emit ITrainingLedger.MemberLeft(runId, newcomer, 1);
        vm.prank(newcomer);
        ledger.leaveRun(runId);
        assertFalse(ledger.isMember(runId, newcomer));
        assertEq(registry.lockedOf(newcomer), 0);

        c = _nextStep(runId);
        _resign(c, 3, newcomerKey);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotMember.selector, runId, newcomer));
        _commit(c);
        // Leaving does not escape an equivocation report of a step it signed.
        vm.prank(_operatorOf("newcomer"));
        registry.unbond(newcomer);
    }

    function test_leaveRun_revertsWith_NotMember() public {
        uint256 runId = _createRewardRun(1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotMember.selector, runId, newcomer));
        vm.prank(newcomer);
        ledger.leaveRun(runId);
    }

    // ---------------------------------------------------------------- rewards

    function test_finalizeSteps_creditsEachAttestedSlotAnEqualShare() public {
        uint256 runId = _createRewardRun(1);
        StepCall memory c = _commitNext(runId);
        vm.warp(block.timestamp + WINDOW + 1);

        address[] memory paid = _signersOf(c);
        vm.expectEmit(address(registry));
        emit INodeRegistry.StepRewarded(runId, 1, REWARD / 4, paid);
        assertEq(ledger.finalizeSteps(runId, _witnesses(c)), 1);
        for (uint256 i = 0; i < 4; ++i) {
            assertEq(registry.creditOf(nodes[i]), REWARD / 4);
        }
        (uint256 pool,) = registry.poolOf(runId);
        assertEq(pool, FUND - REWARD);
        _assertConservation();

        // The node claims its share through the registry; a second claim has nothing.
        uint256 before = nodes[0].balance;
        vm.prank(nodes[0]);
        registry.claim();
        assertEq(nodes[0].balance, before + REWARD / 4);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNothingToClaim.selector, nodes[0]));
        vm.prank(nodes[0]);
        registry.claim();
        _assertConservation();
    }

    function test_finalizeSteps_paysAStepOnce() public {
        uint256 runId = _createRewardRun(1);
        StepCall memory c = _commitNext(runId);
        vm.warp(block.timestamp + WINDOW + 1);
        ITrainingLedger.StepWitness[] memory w = _witnesses(c);
        ledger.finalizeSteps(runId, w);
        // The same witnesses again would be for step 2, which does not exist.
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownStep.selector, runId, 2));
        ledger.finalizeSteps(runId, w);
        assertEq(registry.creditOf(nodes[0]), REWARD / 4);
    }

    function test_finalizeSteps_paysNothingBeforeTheWindowCloses() public {
        uint256 runId = _createRewardRun(1);
        ITrainingLedger.StepWitness[] memory w = _witnesses(_commitNext(runId));
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWindowOpen.selector, runId, 1, block.timestamp + WINDOW));
        ledger.finalizeSteps(runId, w);
        assertEq(registry.creditOf(nodes[0]), 0);
    }

    function test_finalize_revertsWith_RewardNeedsWitnesses_forARewardRun() public {
        uint256 runId = _createRewardRun(1);
        _commitNext(runId);
        vm.warp(block.timestamp + WINDOW + 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerRewardNeedsWitnesses.selector, runId));
        ledger.finalize(runId, 1);
    }

    function test_finalizeSteps_revertsWith_WitnessMismatch_forWrongSigners() public {
        uint256 runId = _createRewardRun(1);
        StepCall memory c = _commitNext(runId);
        vm.warp(block.timestamp + WINDOW + 1);
        ITrainingLedger.StepWitness[] memory w = _witnesses(c);
        w[0].signers[0] = verifier;
        vm.expectPartialRevert(ITrainingLedger.LedgerWitnessMismatch.selector);
        ledger.finalizeSteps(runId, w);
    }

    function test_finalizeSteps_paysWhatIsLeft_whenThePoolRunsLow() public {
        vm.prank(submitter);
        uint256 runId = ledger.createRun{value: REWARD / 2}(_spec(1));
        StepCall memory c = _commitNext(runId);
        vm.warp(block.timestamp + WINDOW + 1);
        ledger.finalizeSteps(runId, _witnesses(c));
        assertEq(registry.creditOf(nodes[0]), REWARD / 8);
        (uint256 pool,) = registry.poolOf(runId);
        assertEq(pool, 0);
        _assertConservation();
    }

    function test_upheldChallenge_paysNothingForTheStep_andSlashedStakeGoesToThePool() public {
        uint256 runId = _createRewardRun(1);
        StepCall memory c = _commitNext(runId);
        uint256 id = _challenge(c, 1, 0);
        ledger.resolveChallenge(id, true, _verdicts(id, true, 2));
        // nodes[2] (replica 1, stage 0) lost its stake: half to the challenger, half to the pool.
        (uint256 pool,) = registry.poolOf(runId);
        assertEq(pool, FUND + MIN_STAKE / 2);
        assertEq(registry.fundedBy(runId, submitter), FUND + MIN_STAKE / 2);
        assertEq(registry.creditOf(verifier), MIN_STAKE + MIN_STAKE / 2);
        vm.warp(block.timestamp + WINDOW + 1);
        ITrainingLedger.StepWitness[] memory w = _witnesses(c);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStepRejected.selector, runId, 1));
        ledger.finalizeSteps(runId, w);
        assertEq(registry.creditOf(nodes[0]), 0);
        _assertConservation();
    }

    function test_aNodeSlashedAfterAStep_forfeitsItsShareOfIt_toThePool() public {
        uint256 runId = _createRewardRun(1);
        StepCall memory c = _commitNext(runId);
        // Equivocation on step 1: the step stands, the node is slashed.
        ITrainingLedger.Attestation memory b = _attestation(keys[2], runId, 1, c.parent, 1, 0);
        b.contribution = keccak256("other");
        (b.r, b.vs) = vm.signCompact(keys[2], _digest(runId, 1, c.parent, b));
        ledger.reportEquivocation(runId, 1, c.parent, c.attestations[2], b);

        vm.warp(block.timestamp + WINDOW + 1);
        ledger.finalizeSteps(runId, _witnesses(c));
        assertEq(registry.creditOf(nodes[0]), REWARD / 4);
        assertEq(registry.creditOf(nodes[2]), 0);
        (uint256 pool,) = registry.poolOf(runId);
        assertEq(pool, FUND + MIN_STAKE / 2 - 3 * (REWARD / 4));
        _assertConservation();
    }

    // ---------------------------------------------------------------- end and withdrawal

    function test_withdrawPool_afterTheEndAndTheDelay_creditsTheFunders() public {
        uint256 runId = _createRewardRun(1);
        StepCall memory c = _commitNext(runId);
        vm.prank(nodes[0]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotCreator.selector, runId, nodes[0]));
        ledger.endRun(runId);
        vm.prank(submitter);
        ledger.endRun(runId);
        StepCall memory late = _nextStep(runId);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerRunEnded.selector, runId));
        _commit(late);

        uint64 until = uint64(block.timestamp) + UNBONDING_DELAY;
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerPoolLocked.selector, runId, until));
        vm.prank(submitter);
        ledger.withdrawPool(runId);
        vm.warp(until);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStepsNotFinal.selector, runId, 0, 1));
        vm.prank(submitter);
        ledger.withdrawPool(runId);

        ledger.finalizeSteps(runId, _witnesses(c));
        vm.prank(submitter);
        ledger.withdrawPool(runId);
        assertEq(registry.creditOf(submitter), FUND - REWARD);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNothingToWithdraw.selector, runId, submitter));
        vm.prank(submitter);
        ledger.withdrawPool(runId);
        _assertConservation();
    }

    function test_claim_cannotBeReentered_byAFunderWithdrawingThePool() public {
        uint256 runId = _createRun();
        ReentrantClaimer claimer = new ReentrantClaimer(registry);
        vm.deal(address(this), 1 ether);
        claimer.fund{value: 1 ether}(ledger, runId);
        ledger.endRun(runId);
        vm.warp(block.timestamp + UNBONDING_DELAY);
        claimer.withdraw(ledger, runId);
        claimer.claim();
        assertTrue(claimer.reentered());
        assertTrue(claimer.reentryFailed());
        assertEq(address(claimer).balance, 1 ether);
        assertEq(registry.creditOf(address(claimer)), 0);
        _assertConservation();
    }

    // ---------------------------------------------------------------- gas

    function test_gas_claim_ofARewardShare_isAtMost60k() public {
        uint256 runId = _createRewardRun(1);
        StepCall memory c = _commitNext(runId);
        vm.warp(block.timestamp + WINDOW + 1);
        ledger.finalizeSteps(runId, _witnesses(c));
        // A claimer holds ETH for gas: paying a fresh account would add 25,000 for creating it.
        vm.deal(nodes[0], 1 ether);
        vm.prank(nodes[0]);
        uint256 start = gasleft();
        registry.claim();
        uint256 used = start - gasleft();
        emit log_named_uint("claim (execution)", used);
        // As its own transaction (`forge test --gas-report`, which isolates each call and
        // counts the 21,000 base) a claim costs 37,637; inline here, with the registry warm,
        // about 17,000. Either way it stays below the issue's 60,000.
        assertLe(used, 60_000);
    }
}
