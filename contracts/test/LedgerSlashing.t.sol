// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {INodeRegistry} from "../src/interfaces/INodeRegistry.sol";
import {ITrainingLedger} from "../src/interfaces/ITrainingLedger.sol";
import {LedgerFixture} from "./utils/LedgerFixture.sol";

/// @dev A non-view no-op: in isolation mode its call costs at least the 21,000 base.
contract GasProbe {
    function poke() external {}
}

/// @notice Stakes behind attestations: equivocation proofs, replay challenges resolved by an
/// arbiter quorum, rollbacks, finality, and how unbonding waits for all of them.
contract LedgerSlashingTest is LedgerFixture {
    address internal reporter = makeAddr("reporter");

    function _stakeTotal(address node) internal view returns (uint256) {
        (uint256 unbonding,) = registry.unbondingOf(node);
        return registry.stakeOf(node) + unbonding;
    }

    function _assertAccounting() internal view {
        assertEq(address(registry).balance, registry.totalStaked() + registry.totalBonds() + registry.totalCredits() + registry.totalPools());
    }

    /// @dev A second, different contribution for slot `slot` of `c`, signed by the same key.
    function _conflicting(StepCall memory c, uint256 slot, bytes32 contribution)
        internal
        view
        returns (ITrainingLedger.Attestation memory b)
    {
        b = c.attestations[slot];
        ITrainingLedger.Attestation memory copy;
        copy.replica = b.replica;
        copy.stage = b.stage;
        copy.replicaSet = b.replicaSet;
        copy.contribution = contribution;
        copy.dataShard = b.dataShard;
        copy.codeHash = b.codeHash;
        copy.lossMicros = b.lossMicros;
        (copy.r, copy.vs) = vm.signCompact(keys[slot % keys.length], _digest(c.runId, c.step, c.parent, copy));
        return copy;
    }

    // ---------------------------------------------------------------- construction and runs

    function test_constructor_capsChallengeWindowsBelowTheUnbondingDelay() public view {
        assertEq(ledger.maxChallengeWindow(), UNBONDING_DELAY - 1);
        assertEq(registry.ledger(), address(ledger));
    }

    function test_createRun_storesWindowArbitersAndQuorum() public {
        uint256 runId = _createRun();
        assertEq(ledger.challengeWindowOf(runId), WINDOW);
        (address[] memory stored, uint32 quorum) = ledger.arbitersOf(runId);
        assertEq(stored, arbiters);
        assertEq(quorum, 2);
        assertEq(ledger.finalizedStep(runId), 0);
        ITrainingLedger.StepInfo memory genesis = ledger.stepInfo(runId, 0);
        assertEq(genesis.checkpoint, GENESIS);
        assertEq(genesis.committedAt, block.timestamp);
    }

    function test_createRun_acceptsTheLongestWindow() public {
        uint64 longest = UNBONDING_DELAY - 1;
        uint256 runId = ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, longest, MIN_STAKE, arbiters, 2, 0));
        assertEq(ledger.challengeWindowOf(runId), longest);
    }

    function test_createRun_revertsWith_WindowTooLong_whenWindowReachesTheUnbondingDelay() public {
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerWindowTooLong.selector, UNBONDING_DELAY, UNBONDING_DELAY - 1)
        );
        ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, UNBONDING_DELAY, MIN_STAKE, arbiters, 2, 0));
    }

    function test_createRun_revertsWith_InvalidArbiter_whenAnArbiterRepeats() public {
        arbiters.push(arbiters[0]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidArbiter.selector, arbiters[0]));
        _createRun();
    }

    function test_createRun_revertsWith_InvalidArbiter_whenAnArbiterIsZero() public {
        arbiters[1] = address(0);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidArbiter.selector, address(0)));
        _createRun();
    }

    function test_runViews_revertWith_UnknownRun_forAnUnknownRun() public {
        bytes memory unknown = abi.encodeWithSelector(ITrainingLedger.LedgerUnknownRun.selector, 5);
        vm.expectRevert(unknown);
        ledger.stepInfo(5, 0);
        vm.expectRevert(unknown);
        ledger.finalizedStep(5);
        vm.expectRevert(unknown);
        ledger.challengeWindowOf(5);
        vm.expectRevert(unknown);
        ledger.arbitersOf(5);
    }

    function test_offenceId_separatesKindsSlotsAndNodes() public view {
        bytes32 base = ledger.offenceId(0, 1, 2, 0, 1, GENESIS, nodes[0]);
        assertTrue(base != ledger.offenceId(1, 1, 2, 0, 1, GENESIS, nodes[0]));
        assertTrue(base != ledger.offenceId(0, 1, 2, 1, 0, GENESIS, nodes[0]));
        assertTrue(base != ledger.offenceId(0, 1, 2, 0, 1, GENESIS, nodes[1]));
        assertEq(base, keccak256(abi.encode(uint8(0), uint256(1), uint64(2), uint32(0), uint32(1), GENESIS, nodes[0])));
    }

    function test_commitStep_recordsSignersTimeAndEpoch() public {
        uint256 runId = _createRun();
        vm.warp(1_000);
        StepCall memory c = _commitNext(runId);
        ITrainingLedger.StepInfo memory info = ledger.stepInfo(runId, 1);
        assertEq(info.checkpoint, c.checkpoint);
        assertEq(info.witnessHash, _witness(_signersOf(c), _shardsRoot(c), 3));
        assertEq(info.committedAt, 1_000);
        assertEq(info.epoch, 0);
        assertEq(info.openChallenges, 0);
        assertFalse(info.rejected);
    }

    // ---------------------------------------------------------------- equivocation

    function test_reportEquivocation_slashesTheNode_paysTheReporter_andEmits() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        ITrainingLedger.Attestation memory b = _conflicting(c, 2, keccak256("other"));

        vm.expectEmit(address(ledger));
        emit ITrainingLedger.EquivocationSlashed(
            runId, 1, nodes[2], 1, 0, c.parent, c.attestations[2].contribution, b.contribution, reporter
        );
        vm.expectEmit(address(registry));
        emit INodeRegistry.Slashed(nodes[2], reporter, MIN_STAKE, MIN_STAKE / 2);
        vm.prank(reporter);
        uint256 slashed = ledger.reportEquivocation(runId, 1, c.parent, c.attestations[2], b);

        assertEq(slashed, MIN_STAKE);
        assertEq(_stakeTotal(nodes[2]), 0);
        assertEq(registry.creditOf(reporter), MIN_STAKE / 2);
        assertEq(registry.totalPools(), MIN_STAKE / 2);
        assertTrue(ledger.isSlashed(ledger.offenceId(0, runId, 1, 1, 0, c.parent, nodes[2])));
        _assertAccounting();
    }

    function test_reportEquivocation_slashedNodeCanNoLongerAttest() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        ledger.reportEquivocation(runId, 1, c.parent, c.attestations[0], _conflicting(c, 0, keccak256("x")));
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientStake.selector, nodes[0], 0, MIN_STAKE)
        );
        _commit(c);
    }

    function test_reportEquivocation_revertsWith_AlreadySlashed_forTheSameOffenceTwice() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        ITrainingLedger.Attestation memory b = _conflicting(c, 1, keccak256("b"));
        ITrainingLedger.Attestation memory third = _conflicting(c, 1, keccak256("c"));
        ledger.reportEquivocation(runId, 1, c.parent, c.attestations[1], b);

        bytes32 offence = ledger.offenceId(0, runId, 1, 0, 1, c.parent, nodes[1]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerAlreadySlashed.selector, offence, nodes[1]));
        ledger.reportEquivocation(runId, 1, c.parent, b, third);
    }

    function test_reportEquivocation_revertsWith_UnknownRun_whenRunDoesNotExist() public {
        StepCall memory c = _nextStep(_createRun());
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownRun.selector, 9));
        ledger.reportEquivocation(9, 1, c.parent, c.attestations[0], c.attestations[1]);
    }

    function test_reportEquivocation_revertsWith_DifferentSlots_whenSlotsDiffer() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerDifferentSlots.selector, 0, 0, 0, 1));
        ledger.reportEquivocation(runId, 1, c.parent, c.attestations[0], c.attestations[1]);
    }

    function test_reportEquivocation_revertsWith_SameContribution_whenContributionsAreEqual() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        ITrainingLedger.Attestation memory a = c.attestations[0];
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerSameContribution.selector, a.contribution));
        ledger.reportEquivocation(runId, 1, c.parent, a, a);
    }

    function test_reportEquivocation_revertsWith_SignerMismatch_whenTwoKeysSigned() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        ITrainingLedger.Attestation memory b = _conflicting(c, 0, keccak256("b"));
        (b.r, b.vs) = vm.signCompact(keys[3], _digest(runId, 1, c.parent, b));
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerSignerMismatch.selector, nodes[0], nodes[3]));
        ledger.reportEquivocation(runId, 1, c.parent, c.attestations[0], b);
    }

    function test_reportEquivocation_doesNotPunish_reAttestingAStepOnANewParent() public {
        // After a rollback an honest node signs the same step again over a new parent: the
        // two signatures are over different parents, so no single parent makes them a pair.
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        ITrainingLedger.Attestation memory other = _attestation(keys[0], runId, 1, keccak256("new parent"), 0, 0);
        other.contribution = keccak256("recomputed");
        (other.r, other.vs) = vm.signCompact(keys[0], _digest(runId, 1, keccak256("new parent"), other));
        address recovered = ECDSA.recover(_digest(runId, 1, c.parent, other), other.r, other.vs);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerSignerMismatch.selector, nodes[0], recovered));
        ledger.reportEquivocation(runId, 1, c.parent, c.attestations[0], other);
    }

    function test_reportEquivocation_revertsWith_NotMember_whenSignerIsNotInTheRun() public {
        (, uint256 outsiderKey) = _addStakedNode("outsider", MIN_STAKE);
        nodes.pop();
        keys.pop();
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        _resign(c, 0, outsiderKey);
        ITrainingLedger.Attestation memory b = c.attestations[0];
        ITrainingLedger.Attestation memory a = _conflicting(c, 0, keccak256("b"));
        (a.r, a.vs) = vm.signCompact(outsiderKey, _digest(runId, 1, c.parent, a));
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotMember.selector, runId, makeAddr("outsider")));
        ledger.reportEquivocation(runId, 1, c.parent, a, b);
    }

    function test_reportEquivocation_revertsWith_ECDSAInvalidSignatureS_whenSignatureIsMalformed() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        ITrainingLedger.Attestation memory b = _conflicting(c, 0, keccak256("b"));
        b.vs = bytes32(type(uint256).max); // s above n / 2: malleable, refused
        vm.expectRevert(abi.encodeWithSelector(ECDSA.ECDSAInvalidSignatureS.selector, bytes32(type(uint256).max >> 1)));
        ledger.reportEquivocation(runId, 1, c.parent, c.attestations[0], b);
    }

    function testFuzz_reportEquivocation_slashesAnyTwoDifferentContributions(bytes32 x, bytes32 y, uint8 slot) public {
        vm.assume(x != y);
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        uint256 i = bound(slot, 0, 3);
        ITrainingLedger.Attestation memory a = _conflicting(c, i, x);
        ITrainingLedger.Attestation memory b = _conflicting(c, i, y);
        uint256 slashed = ledger.reportEquivocation(runId, 1, c.parent, a, b);
        assertEq(slashed, MIN_STAKE);
        assertEq(_stakeTotal(nodes[i]), 0);
        _assertAccounting();
    }

    // ---------------------------------------------------------------- openChallenge

    function test_openChallenge_holdsTheBond_locksTheNode_andEmits() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);

        vm.expectEmit(address(ledger));
        emit ITrainingLedger.ChallengeOpened(1, runId, 1, nodes[3], 0, 1, 1, verifier, MIN_STAKE, keccak256("evidence"));
        vm.prank(verifier);
        uint256 id = ledger.openChallenge{value: MIN_STAKE}(
            runId, 1, 1, 1, _fullSet(2), signers, _shardsRootAt(runId, 1), keccak256("evidence")
        );

        assertEq(id, 1);
        assertEq(ledger.challengeCount(), 1);
        ITrainingLedger.Challenge memory ch = ledger.challenge(1);
        assertEq(ch.runId, runId);
        assertEq(ch.step, 1);
        assertEq(ch.node, nodes[3]);
        assertEq(ch.challenger, verifier);
        assertEq(ch.bond, MIN_STAKE);
        assertFalse(ch.resolved);
        assertEq(ledger.stepInfo(runId, 1).openChallenges, 1);
        assertEq(registry.openChallengesOf(nodes[3]), 1);
        assertEq(registry.totalBonds(), MIN_STAKE);
        _assertAccounting();
    }

    function test_openChallenge_revertsWith_UnknownRun_whenRunDoesNotExist() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownRun.selector, 1));
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(1, 1, 0, 0, _fullSet(2), nodes, _shardsRootAt(1, 1), bytes32(0));
    }

    function test_openChallenge_revertsWith_NoArbiters_whenTheRunHasNone() public {
        uint256 runId = ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, WINDOW, MIN_STAKE, new address[](0), 0, 0));
        address[] memory signers = _signersOf(_commitNext(runId));
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNoArbiters.selector, runId));
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 0, 0, _fullSet(2), signers, _shardsRootAt(runId, 1), bytes32(0));
    }

    function test_openChallenge_revertsWith_UnknownStep_whenStepIsAboveTheHead() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownStep.selector, runId, 2));
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 2, 0, 0, _fullSet(2), signers, _shardsRootAt(runId, 2), bytes32(0));
    }

    function test_openChallenge_revertsWith_StepFinalized_forTheGenesis() public {
        uint256 runId = _createRun();
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStepFinalized.selector, runId, 0));
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 0, 0, 0, _fullSet(2), nodes, _shardsRootAt(runId, 0), bytes32(0));
    }

    function test_openChallenge_revertsWith_WindowClosed_afterTheWindow() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        uint64 deadline = uint64(block.timestamp) + WINDOW;
        vm.warp(deadline + 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWindowClosed.selector, runId, 1, deadline));
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 0, 0, _fullSet(2), signers, _shardsRootAt(runId, 1), bytes32(0));
    }

    function test_openChallenge_revertsWith_SlotOutOfRange_whenSlotIsOutsideTheShape() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerSlotOutOfRange.selector, runId, 2, 0));
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 2, 0, _fullSet(2), signers, _shardsRootAt(runId, 1), bytes32(0));
    }

    function test_openChallenge_revertsWith_WitnessMismatch_whenSignersAreWrong() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        bytes32 root = _shardsRoot(c);
        bytes20 expected = _witness(signers, root, 3);
        signers[1] = signers[0];
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerWitnessMismatch.selector, expected, _witness(signers, root, 3))
        );
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 0, 1, _fullSet(2), signers, root, bytes32(0));
    }

    function test_openChallenge_revertsWith_WitnessMismatch_whenTheShardsRootIsWrong() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        bytes20 expected = _witness(signers, _shardsRoot(c), 3);
        vm.expectRevert(
            abi.encodeWithSelector(
                ITrainingLedger.LedgerWitnessMismatch.selector, expected, _witness(signers, keccak256("other"), 3)
            )
        );
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 0, 1, _fullSet(2), signers, keccak256("other"), bytes32(0));
    }

    function test_openChallenge_revertsWith_InsufficientStake_whenTheChallengerIsNotStaked() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        vm.deal(reporter, 10 ether);
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientStake.selector, reporter, 0, MIN_STAKE)
        );
        vm.prank(reporter);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 0, 0, _fullSet(2), signers, _shardsRootAt(runId, 1), bytes32(0));
    }

    function test_openChallenge_revertsWith_InsufficientBond_whenTheBondIsBelowTheMinimumStake() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientBond.selector, MIN_STAKE, MIN_STAKE - 1)
        );
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE - 1}(runId, 1, 0, 0, _fullSet(2), signers, _shardsRootAt(runId, 1), bytes32(0));
    }

    function testFuzz_openChallenge_isAllowedExactlyWithinTheWindow(uint64 wait) public {
        wait = uint64(bound(wait, 0, 3 * uint256(WINDOW)));
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        uint64 deadline = uint64(block.timestamp) + WINDOW;
        vm.warp(block.timestamp + wait);
        if (wait > WINDOW) {
            vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWindowClosed.selector, runId, 1, deadline));
        }
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 0, 0, _fullSet(2), signers, _shardsRootAt(runId, 1), bytes32(0));
    }

    // ---------------------------------------------------------------- resolveChallenge

    function test_resolveChallenge_upheld_slashesRejectsDescendantsRollsBackAndPaysTheChallenger() public {
        uint256 runId = _createRun();
        StepCall memory s1 = _commitNext(runId);
        StepCall memory s2 = _commitNext(runId);
        StepCall memory s3 = _commitNext(runId);
        uint256 id = _challenge(s2, 0, 1);
        bytes[] memory sigs = _verdicts(id, true, 2);

        vm.expectEmit(address(ledger));
        emit ITrainingLedger.StepRejected(runId, 2, s2.checkpoint, id);
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.StepRejected(runId, 3, s3.checkpoint, id);
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.HeadRolledBack(runId, 3, 1, s1.checkpoint);
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.ChallengeResolved(id, runId, 2, nodes[1], true, true);
        vm.expectEmit(address(registry));
        emit INodeRegistry.Slashed(nodes[1], verifier, MIN_STAKE, MIN_STAKE / 2);
        ledger.resolveChallenge(id, true, sigs);

        (bytes32 head, uint64 headStep) = ledger.runHead(runId);
        assertEq(head, s1.checkpoint);
        assertEq(headStep, 1);
        assertTrue(ledger.stepInfo(runId, 2).rejected);
        assertTrue(ledger.stepInfo(runId, 3).rejected);
        assertFalse(ledger.stepInfo(runId, 1).rejected);
        assertEq(ledger.stepCheckpoint(runId, 2), bytes32(0));
        assertEq(_stakeTotal(nodes[1]), 0);
        // Bond back plus the reporter's half of the slashed stake.
        assertEq(registry.creditOf(verifier), MIN_STAKE + MIN_STAKE / 2);
        assertEq(registry.totalPools(), MIN_STAKE / 2);
        assertEq(registry.openChallengesOf(nodes[1]), 0);
        assertTrue(ledger.challenge(id).resolved);
        _assertAccounting();

        // The chain continues from the last good checkpoint, in a new epoch.
        salt = 1;
        StepCall memory redo = _nextStep(runId);
        assertEq(redo.step, 2);
        assertEq(redo.parent, s1.checkpoint);
        _resign(redo, 1, keys[0]); // the slashed node's slot is taken over
        redo.contributionsRoot = _root(redo.attestations);
        _commit(redo);
        assertEq(ledger.stepInfo(runId, 2).epoch, 1);
        assertFalse(ledger.stepInfo(runId, 2).rejected);
    }

    function test_resolveChallenge_notUpheld_paysTheBondToTheNodesOperator() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        uint256 id = _challenge(c, 1, 0);

        vm.expectEmit(address(ledger));
        emit ITrainingLedger.ChallengeResolved(id, runId, 1, nodes[2], false, false);
        ledger.resolveChallenge(id, false, _verdicts(id, false, 3));

        assertEq(registry.creditOf(_operatorOf("node2")), MIN_STAKE);
        assertEq(_stakeTotal(nodes[2]), MIN_STAKE);
        assertEq(ledger.stepInfo(runId, 1).openChallenges, 0);
        (, uint64 headStep) = ledger.runHead(runId);
        assertEq(headStep, 1);
        _assertAccounting();
    }

    function test_resolveChallenge_upheldTwiceForOneSlot_slashesOnlyOnce() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        registry.stake{value: 5 ether}(nodes[0]);
        uint256 first = _challenge(c, 0, 0);
        uint256 second = _challenge(c, 0, 0);
        ledger.resolveChallenge(first, true, _verdicts(first, true, 2));
        vm.deal(address(this), 5 ether);

        vm.expectEmit(address(ledger));
        emit ITrainingLedger.ChallengeResolved(second, runId, 1, nodes[0], true, false);
        ledger.resolveChallenge(second, true, _verdicts(second, true, 2));
        // Both bonds come back; the reward was paid once.
        assertEq(registry.creditOf(verifier), 2 * MIN_STAKE + 3 ether);
        _assertAccounting();
    }

    function test_resolveChallenge_onAStepRejectedWithItsAncestor_slashesWithoutAnotherRollback() public {
        uint256 runId = _createRun();
        StepCall memory s1 = _commitNext(runId);
        StepCall memory s2 = _commitNext(runId);
        uint256 onChild = _challenge(s2, 1, 1);
        uint256 onParent = _challenge(s1, 0, 0);
        ledger.resolveChallenge(onParent, true, _verdicts(onParent, true, 2));
        (, uint64 headStep) = ledger.runHead(runId);
        assertEq(headStep, 0);

        ledger.resolveChallenge(onChild, true, _verdicts(onChild, true, 2));
        (, headStep) = ledger.runHead(runId);
        assertEq(headStep, 0);
        assertEq(_stakeTotal(nodes[3]), 0);
        _assertAccounting();
    }

    function test_resolveChallenge_ofAStaleRecord_leavesTheNewRecordAlone() public {
        (uint256 runId, uint256 onChild, uint256 fresh) = _challengesOnAStaleAndANewStep2();
        assertEq(ledger.stepInfo(runId, 2).openChallenges, 1);

        // Resolving the old challenge on step 2 does not touch the new step 2's count.
        ledger.resolveChallenge(onChild, false, _verdicts(onChild, false, 2));
        assertEq(ledger.stepInfo(runId, 2).openChallenges, 1);
        assertFalse(ledger.stepInfo(runId, 2).rejected);
        ledger.resolveChallenge(fresh, false, _verdicts(fresh, false, 2));
        assertEq(ledger.stepInfo(runId, 2).openChallenges, 0);
        _assertAccounting();
    }

    /// @dev A run whose step 2 was challenged (`onChild`), then rejected with step 1 by an
    /// upheld challenge on step 1, then committed again (node1, slashed, replaced by node0)
    /// and challenged once more (`fresh`).
    function _challengesOnAStaleAndANewStep2() internal returns (uint256 runId, uint256 onChild, uint256 fresh) {
        runId = _createRun();
        StepCall memory s1 = _commitNext(runId);
        StepCall memory s2 = _commitNext(runId);
        onChild = _challenge(s2, 0, 0);
        uint256 onParent = _challenge(s1, 0, 1);
        ledger.resolveChallenge(onParent, true, _verdicts(onParent, true, 2));
        salt = 7;
        _commitNextReplacing(runId, 1);
        StepCall memory again = _commitNextReplacing(runId, 1);
        fresh = _challenge(again, 1, 1);
    }

    /// @dev Commits the next step of `runId` with slot `slot` signed by node0 instead.
    function _commitNextReplacing(uint256 runId, uint256 slot) internal returns (StepCall memory c) {
        c = _nextStep(runId);
        _resign(c, slot, keys[0]);
        _commit(c);
    }

    function test_resolveChallenge_revertsWith_UnknownChallenge_whenIdIsUnused() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownChallenge.selector, 1));
        ledger.resolveChallenge(1, true, new bytes[](0));
    }

    function test_challenge_revertsWith_UnknownChallenge_whenIdIsZero() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownChallenge.selector, 0));
        ledger.challenge(0);
    }

    function test_resolveChallenge_revertsWith_ChallengeResolved_whenResolvedTwice() public {
        StepCall memory c = _commitNext(_createRun());
        uint256 id = _challenge(c, 0, 0);
        ledger.resolveChallenge(id, false, _verdicts(id, false, 2));
        bytes[] memory sigs = _verdicts(id, true, 2);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerChallengeResolved.selector, id));
        ledger.resolveChallenge(id, true, sigs);
    }

    function test_resolveChallenge_revertsWith_QuorumNotReached_withTooFewSignatures() public {
        StepCall memory c = _commitNext(_createRun());
        uint256 id = _challenge(c, 0, 0);
        bytes[] memory sigs = _verdicts(id, true, 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerQuorumNotReached.selector, 1, 2));
        ledger.resolveChallenge(id, true, sigs);
    }

    function test_resolveChallenge_revertsWith_VerdictsNotSorted_whenOneArbiterSignsTwice() public {
        StepCall memory c = _commitNext(_createRun());
        uint256 id = _challenge(c, 0, 0);
        bytes[] memory sigs = _verdicts(id, true, 2);
        sigs[1] = sigs[0];
        uint256[] memory order = _arbitersAscending();
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerVerdictsNotSorted.selector, 1, arbiters[order[0]]));
        ledger.resolveChallenge(id, true, sigs);
    }

    function test_resolveChallenge_revertsWith_NotArbiter_whenAStrangerSigns() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        uint256 id = _challenge(c, 0, 0);
        bytes[] memory sigs = _verdicts(id, true, 2);
        (address stranger, uint256 strangerKey) = makeAddrAndKey("stranger");
        sigs[0] = _sign(strangerKey, ledger.verdictDigest(id, true));
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotArbiter.selector, runId, stranger));
        ledger.resolveChallenge(id, true, sigs);
    }

    function test_resolveChallenge_revertsWith_NotArbiter_whenVerdictsAreForTheOtherOutcome() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        uint256 id = _challenge(c, 0, 0);
        bytes[] memory sigs = _verdicts(id, false, 2);
        address recovered = ECDSA.recover(ledger.verdictDigest(id, true), sigs[0]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotArbiter.selector, runId, recovered));
        ledger.resolveChallenge(id, true, sigs);
    }

    function testFuzz_resolveChallenge_rollsBackToTheChallengedStepsParent(uint8 length, uint8 target) public {
        uint256 runId = _createRun();
        uint64 steps = uint64(bound(length, 1, 6));
        StepCall[] memory committed = new StepCall[](steps + 1);
        for (uint64 i = 1; i <= steps; ++i) {
            committed[i] = _commitNext(runId);
        }
        uint64 challenged = uint64(bound(target, 1, steps));
        uint256 id = _challenge(committed[challenged], 1, 0);
        ledger.resolveChallenge(id, true, _verdicts(id, true, 2));

        (bytes32 head, uint64 headStep) = ledger.runHead(runId);
        assertEq(headStep, challenged - 1);
        assertEq(head, challenged == 1 ? GENESIS : committed[challenged - 1].checkpoint);
        for (uint64 i = 1; i <= steps; ++i) {
            assertEq(ledger.stepInfo(runId, i).rejected, i >= challenged);
        }
        _assertAccounting();
    }

    // ---------------------------------------------------------------- finalize

    function test_constructor_givesArbitersTheUnbondingDelayToRule() public view {
        assertEq(ledger.resolutionPeriod(), UNBONDING_DELAY);
    }

    function test_expireChallenge_afterThePeriod_refundsTheChallenger_freesTheNode_andTheStep() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        uint256 id = _challenge(c, 1, 0);
        uint256 opened = block.timestamp;
        assertEq(ledger.challenge(id).openedAt, opened);

        vm.warp(opened + UNBONDING_DELAY + 1);
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.ChallengeExpired(id, runId, 1, nodes[2]);
        vm.prank(makeAddr("anyone"));
        ledger.expireChallenge(id);

        assertTrue(ledger.challenge(id).resolved);
        assertEq(registry.creditOf(verifier), MIN_STAKE); // the bond, and no more
        assertEq(registry.openChallengesOf(nodes[2]), 0);
        assertEq(_stakeTotal(nodes[2]), MIN_STAKE); // not slashed
        assertEq(ledger.stepInfo(runId, 1).openChallenges, 0);
        assertFalse(ledger.stepInfo(runId, 1).rejected);
        ledger.finalize(runId, 1);
        assertEq(ledger.finalizedStep(runId), 1);
        _assertAccounting();
    }

    function test_expireChallenge_revertsWith_ResolutionPending_atTheDeadline() public {
        StepCall memory c = _commitNext(_createRun());
        uint256 id = _challenge(c, 0, 0);
        uint256 deadline = block.timestamp + UNBONDING_DELAY;
        vm.warp(deadline);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerResolutionPending.selector, id, deadline));
        ledger.expireChallenge(id);
    }

    function test_expireChallenge_revertsWith_ChallengeResolved_afterAVerdict_andAfterExpiry() public {
        StepCall memory c = _commitNext(_createRun());
        uint256 ruled = _challenge(c, 0, 0);
        uint256 ignored = _challenge(c, 1, 1);
        ledger.resolveChallenge(ruled, false, _verdicts(ruled, false, 2));
        vm.warp(block.timestamp + UNBONDING_DELAY + 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerChallengeResolved.selector, ruled));
        ledger.expireChallenge(ruled);

        ledger.expireChallenge(ignored);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerChallengeResolved.selector, ignored));
        ledger.expireChallenge(ignored);
        bytes[] memory sigs = _verdicts(ignored, true, 2); // a late verdict changes nothing
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerChallengeResolved.selector, ignored));
        ledger.resolveChallenge(ignored, true, sigs);
        _assertAccounting();
    }

    function test_expireChallenge_revertsWith_UnknownChallenge_whenIdIsUnused() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownChallenge.selector, 9));
        ledger.expireChallenge(9);
    }

    function test_expireChallenge_ofAStaleRecord_leavesTheNewRecordAlone() public {
        (uint256 runId, uint256 onChild,) = _challengesOnAStaleAndANewStep2();

        vm.warp(block.timestamp + UNBONDING_DELAY + 1);
        ledger.expireChallenge(onChild); // the rejected step 2's challenge
        assertEq(ledger.stepInfo(runId, 2).openChallenges, 1); // the new step 2's stays open
        _assertAccounting();
    }

    function test_finalize_afterTheWindow_makesTheStepFinal_andEmits() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        vm.warp(block.timestamp + WINDOW + 1);
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.StepFinalized(runId, 1, c.checkpoint);
        vm.prank(reporter);
        ledger.finalize(runId, 1);
        assertEq(ledger.finalizedStep(runId), 1);
    }

    function test_finalize_revertsWith_WindowOpen_atTheDeadline() public {
        uint256 runId = _createRun();
        _commitNext(runId);
        uint64 deadline = uint64(block.timestamp) + WINDOW;
        vm.warp(deadline);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWindowOpen.selector, runId, 1, deadline));
        ledger.finalize(runId, 1);
    }

    function test_finalize_revertsWith_ParentNotFinal_whenSkippingAStep() public {
        uint256 runId = _createRun();
        _commitNext(runId);
        _commitNext(runId);
        vm.warp(block.timestamp + WINDOW + 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerParentNotFinal.selector, runId, 2));
        ledger.finalize(runId, 2);
    }

    function test_finalize_revertsWith_StepFinalized_whenAlreadyFinal() public {
        uint256 runId = _createRun();
        _commitNext(runId);
        vm.warp(block.timestamp + WINDOW + 1);
        ledger.finalize(runId, 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStepFinalized.selector, runId, 1));
        ledger.finalize(runId, 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStepFinalized.selector, runId, 0));
        ledger.finalize(runId, 0);
    }

    function test_finalize_revertsWith_UnknownStep_aboveTheHead() public {
        uint256 runId = _createRun();
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownStep.selector, runId, 1));
        ledger.finalize(runId, 1);
    }

    function test_finalize_revertsWith_UnknownRun_whenRunDoesNotExist() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownRun.selector, 3));
        ledger.finalize(3, 1);
    }

    function test_finalize_revertsWith_StepRejected_forARejectedStep() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        uint256 id = _challenge(c, 0, 0);
        ledger.resolveChallenge(id, true, _verdicts(id, true, 2));
        vm.warp(block.timestamp + WINDOW + 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStepRejected.selector, runId, 1));
        ledger.finalize(runId, 1);
        // Nor can a rejected step be challenged again.
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStepRejected.selector, runId, 1));
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 0, 0, _fullSet(2), signers, _shardsRootAt(runId, 1), bytes32(0));
    }

    function test_finalize_revertsWith_StepChallenged_whileAChallengeIsOpen() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        uint256 id = _challenge(c, 0, 0);
        vm.warp(block.timestamp + WINDOW + 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStepChallenged.selector, runId, 1, 1));
        ledger.finalize(runId, 1);
        ledger.resolveChallenge(id, false, _verdicts(id, false, 2));
        ledger.finalize(runId, 1);
    }

    function test_openChallenge_revertsWith_StepFinalized_onAFinalStep() public {
        // The longest window keeps the step challengeable in time; finality still closes it.
        uint256 runId = _createRun();
        address[] memory signers = _signersOf(_commitNext(runId));
        vm.warp(block.timestamp + WINDOW + 1);
        ledger.finalize(runId, 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStepFinalized.selector, runId, 1));
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 0, 0, _fullSet(2), signers, _shardsRootAt(runId, 1), bytes32(0));
    }

    function testFuzz_finalize_opensExactlyAfterTheDeadline(uint64 window, uint64 wait) public {
        window = uint64(bound(window, 0, UNBONDING_DELAY - 1));
        wait = uint64(bound(wait, 0, 2 * uint256(UNBONDING_DELAY)));
        uint256 runId = ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, window, MIN_STAKE, arbiters, 2, 0));
        _commitNext(runId);
        uint64 deadline = uint64(block.timestamp) + window;
        vm.warp(block.timestamp + wait);
        if (wait <= window) {
            vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWindowOpen.selector, runId, 1, deadline));
        }
        ledger.finalize(runId, 1);
    }

    // ---------------------------------------------------------------- unbonding meets challenges

    function test_unbondingNode_cannotAttestAnyMore() public {
        uint256 runId = _createRun();
        vm.prank(_operatorOf("node2"));
        registry.unbond(nodes[2]);
        StepCall memory c = _nextStep(runId);
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientStake.selector, nodes[2], 0, MIN_STAKE)
        );
        _commit(c);
    }

    function test_unbondingStake_isStillSlashed_andWithdrawalWaitsForTheChallenge() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address operator = _operatorOf("node0");
        vm.prank(operator);
        registry.unbond(nodes[0]);
        uint256 id = _challenge(c, 0, 0);

        vm.warp(block.timestamp + UNBONDING_DELAY);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryUnderChallenge.selector, nodes[0], 1));
        vm.prank(operator);
        registry.withdraw(nodes[0]);

        ledger.resolveChallenge(id, true, _verdicts(id, true, 2));
        assertEq(_stakeTotal(nodes[0]), 0);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryNotUnbonding.selector, nodes[0]));
        vm.prank(operator);
        registry.withdraw(nodes[0]);
    }

    function testFuzz_unbonding_cannotFinishWhileAnAttestedStepIsChallengeable(uint64 window, uint64 gap) public {
        window = uint64(bound(window, 0, UNBONDING_DELAY - 1));
        gap = uint64(bound(gap, 0, UNBONDING_DELAY));
        uint256 runId = ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, window, MIN_STAKE, arbiters, 2, 0));
        address[] memory signers = _signersOf(_commitNext(runId));
        uint64 deadline = uint64(block.timestamp) + window;
        // The node unbonds some time after its last attestation ...
        vm.warp(block.timestamp + gap);
        vm.prank(_operatorOf("node0"));
        registry.unbond(nodes[0]);
        (, uint64 releaseAt) = registry.unbondingOf(nodes[0]);
        // ... and its stake is released only after the last moment a challenge can open.
        assertGt(releaseAt, deadline);
        vm.warp(releaseAt);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWindowClosed.selector, runId, 1, deadline));
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 0, 0, _fullSet(2), signers, _shardsRootAt(runId, 1), bytes32(0));
        vm.prank(_operatorOf("node0"));
        registry.withdraw(nodes[0]);
    }

    // ---------------------------------------------------------------- gas targets

    /// @dev Execution gas of one commitStep of a 1 x `slots` run, with every slot cold as in
    /// a fresh transaction. `steady`: the run's previous step had the same signers and no
    /// stake went down since (the usual case); otherwise it is the run's first commit, which
    /// checks every signer's membership and stake.
    function _commitGas(uint32 slots, bool steady) internal returns (uint256) {
        for (uint256 i = nodes.length; i < slots; ++i) {
            _addStakedNode(string.concat("extra", vm.toString(i)), MIN_STAKE);
        }
        uint256 runId = ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 1, slots, 1, WINDOW, MIN_STAKE, arbiters, 2, 0));
        _shapes[runId] = [uint32(1), slots];
        if (steady) _commitNext(runId);
        StepCall memory c = _nextStep(runId);
        vm.cool(address(ledger));
        vm.cool(address(registry));
        _commit(c);
        return _executionGas(
            abi.encodeCall(
                ledger.commitStep,
                (c.runId, c.step, c.parent, c.checkpoint, c.contributionsRoot, c.metricsDigest, c.replicaSet, c.attestations)
            )
        );
    }

    /// @dev The execution gas of the last call, whose calldata was `data`. `forge test
    /// --gas-report` runs each call as its own transaction (isolation), so there the last
    /// call's gas also holds the 21,000 base and the calldata (4 per zero byte, 16 per
    /// other); take them out so the targets are checked the same way in both modes.
    function _executionGas(bytes memory data) internal returns (uint256 used) {
        used = vm.lastCallGas().gasTotalUsed;
        GasProbe probe = new GasProbe();
        probe.poke();
        if (vm.lastCallGas().gasTotalUsed < 21_000) return used;
        uint256 intrinsic = 21_000;
        for (uint256 i = 0; i < data.length; ++i) {
            intrinsic += data[i] == 0 ? 4 : 16;
        }
        emit log_named_uint("isolated: transaction gas incl. base and calldata", used);
        return used - intrinsic;
    }

    /// @dev The transaction gas of one commitStep of a 1 x `slots` run (base, calldata and
    /// execution): the figure the README reports.
    function _commitTxGas(uint32 slots, bool steady) internal returns (uint256) {
        uint256 execution = _commitGas(slots, steady);
        StepCall memory c = _nextStep(ledger.runCount());
        bytes memory data = abi.encodeCall(
            ledger.commitStep,
            (c.runId, c.step, c.parent, c.checkpoint, c.contributionsRoot, c.metricsDigest, c.replicaSet, c.attestations)
        );
        uint256 intrinsic = 21_000;
        for (uint256 i = 0; i < data.length; ++i) {
            intrinsic += data[i] == 0 ? 4 : 16;
        }
        return execution + intrinsic;
    }

    function test_gas_commitStep_transaction_withFourAttestations_isAtMost160k_andEachFurtherAtMost14k() public {
        uint256 four = _commitTxGas(4, true);
        uint256 eight = _commitTxGas(8, true);
        uint256 sixteen = _commitTxGas(16, true);
        emit log_named_uint("transaction: commitStep, 4 attestations, steady", four);
        emit log_named_uint("transaction: per further attestation, steady (4 -> 8)", (eight - four) / 4);
        emit log_named_uint("transaction: per further attestation, steady (4 -> 16)", (sixteen - four) / 12);
        assertLe(four, 160_000);
        assertLe((eight - four) / 4, 14_000);
        assertLe((sixteen - four) / 12, 14_000);
    }

    function test_gas_commitStep_withFourAttestations_isAtMost200k() public {
        uint256 first = _commitGas(4, false);
        uint256 steady = _commitGas(4, true);
        emit log_named_uint("commitStep, 4 attestations, first step", first);
        emit log_named_uint("commitStep, 4 attestations, steady", steady);
        assertLe(first, 200_000);
        assertLe(steady, 200_000);
    }

    function test_gas_commitStep_eachFurtherAttestation_isAtMost12k_whenSignersAreSteady() public {
        uint256 four = _commitGas(4, true);
        uint256 eight = _commitGas(8, true);
        uint256 sixteen = _commitGas(16, true);
        emit log_named_uint("commitStep, 8 attestations, steady", eight);
        emit log_named_uint("commitStep, 16 attestations, steady", sixteen);
        emit log_named_uint("per further attestation, steady (4 -> 8)", (eight - four) / 4);
        emit log_named_uint("per further attestation, steady (4 -> 16)", (sixteen - four) / 12);
        assertLe((eight - four) / 4, 12_000);
        assertLe((sixteen - four) / 12, 12_000);
    }

    /// @dev When the eligibility cache misses (a run's first step, new signers, or any stake
    /// drop in the registry since), each further slot also pays two cold reads: its run
    /// membership and its registry stake (2,100 each). This pins that path's ceiling.
    function test_gas_commitStep_eachFurtherAttestation_staysUnder16k_onAFullCheck() public {
        uint256 four = _commitGas(4, false);
        uint256 sixteen = _commitGas(16, false);
        emit log_named_uint("commitStep, 16 attestations, first step", sixteen);
        emit log_named_uint("per further attestation, first step (4 -> 16)", (sixteen - four) / 12);
        assertLe((sixteen - four) / 12, 16_000);
    }

    // ---------------------------------------------------------------- eligibility cache

    function test_commitStep_withTheSameSigners_afterAnUnbond_refusesTheUnbondedSigner() public {
        uint256 runId = _createRun();
        _commitNext(runId);
        vm.prank(_operatorOf("node2"));
        registry.unbond(nodes[2]);
        StepCall memory c = _nextStep(runId);
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientStake.selector, nodes[2], 0, MIN_STAKE)
        );
        _commit(c);
    }

    function test_commitStep_withTheSameSigners_afterASlash_refusesTheSlashedSigner() public {
        uint256 runId = _createRun();
        StepCall memory s1 = _commitNext(runId);
        ledger.reportEquivocation(runId, 1, s1.parent, s1.attestations[1], _conflicting(s1, 1, keccak256("x")));
        StepCall memory c = _nextStep(runId);
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientStake.selector, nodes[1], 0, MIN_STAKE)
        );
        _commit(c);
    }

    function test_commitStep_withNewSigners_checksThemInFull() public {
        (address outsider, uint256 outsiderKey) = _addStakedNode("outsider", MIN_STAKE);
        nodes.pop();
        keys.pop();
        uint256 runId = _createRun();
        _commitNext(runId);
        StepCall memory c = _nextStep(runId);
        _resign(c, 3, outsiderKey);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotMember.selector, runId, outsider));
        _commit(c);
    }

    function test_stakeDecreases_countsUnbondsAndSlashes() public {
        assertEq(registry.stakeDecreases(), 0);
        vm.prank(_operatorOf("node0"));
        registry.unbond(nodes[0]);
        assertEq(registry.stakeDecreases(), 1);
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        ledger.reportEquivocation(runId, 1, c.parent, c.attestations[1], _conflicting(c, 1, keccak256("x")));
        assertEq(registry.stakeDecreases(), 2);
    }

    function test_gas_finalize_isAtMost50k() public {
        uint256 runId = _createRun();
        _commitNext(runId);
        vm.warp(block.timestamp + WINDOW + 1);
        vm.cool(address(ledger));
        ledger.finalize(runId, 1);
        uint256 used = _executionGas(abi.encodeCall(ledger.finalize, (runId, 1)));
        emit log_named_uint("finalize", used);
        assertLe(used, 50_000);
    }
}
