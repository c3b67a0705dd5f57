// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Vm} from "forge-std/Vm.sol";

import {ITrainingLedger} from "../src/interfaces/ITrainingLedger.sol";
import {LedgerFixture} from "./utils/LedgerFixture.sol";

/// @notice Partial steps (elastic replicas): a run states the fewest replicas a step may
/// have, each step names the replicas that took part as a bitmap, and its attestations must
/// be exactly one per (replica in the set, stage), all signed over that set.
contract LedgerReplicaSetsTest is LedgerFixture {
    /// @dev Replicas {0, 2} of three.
    uint256 internal constant EDGES = 5;
    uint256 internal constant ALL3 = 7;

    address internal reporter = makeAddr("reporter");

    function setUp() public override {
        super.setUp();
        // Six staked nodes: slot (r, s) of a 3 x 2 run is signed by key r * 2 + s, each its own.
        _addStakedNode("node4", MIN_STAKE);
        _addStakedNode("node5", MIN_STAKE);
    }

    /// @dev A 3 x 2 run over the six nodes whose steps need two of the three replicas.
    function _create3x2() internal returns (uint256) {
        return _createElasticRun(3, 2, 2);
    }

    /// @dev `c` with attestation `index` removed (its contributions root recomputed).
    function _without(StepCall memory c, uint256 index) internal pure returns (StepCall memory) {
        ITrainingLedger.Attestation[] memory kept = new ITrainingLedger.Attestation[](c.attestations.length - 1);
        for (uint256 i = 0; i < kept.length; ++i) {
            kept[i] = c.attestations[i < index ? i : i + 1];
        }
        c.attestations = kept;
        c.contributionsRoot = _root(kept);
        return c;
    }

    // ---------------------------------------------------------------- createRun

    function test_createRun_storesMinReplicas_andEmitsIt() public {
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.RunCreated(
            1, address(this), CONFIG, GENESIS, 3, 2, 2, nodes, ITrainingLedger.Independence.Keys
        );
        _create3x2();
    }

    function test_createRun_revertsWith_InvalidMinReplicas_whenZero() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidMinReplicas.selector, 0, 3));
        ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 3, 2, 0, WINDOW, MIN_STAKE, arbiters, 2, 0));
    }

    function test_createRun_revertsWith_InvalidMinReplicas_whenAboveReplicas() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidMinReplicas.selector, 4, 3));
        ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 3, 2, 4, WINDOW, MIN_STAKE, arbiters, 2, 0));
    }

    function test_createRun_revertsWith_InvalidShape_whenReplicasExceedTheBitmap() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidShape.selector, 257, 1));
        ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 257, 1, 1, WINDOW, MIN_STAKE, arbiters, 2, 0));
    }

    function test_createRun_accepts256Replicas() public {
        uint256 runId = ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 256, 1, 256, WINDOW, MIN_STAKE, arbiters, 2, 0));
        assertEq(runId, 1);
    }

    // ---------------------------------------------------------------- accepted sets

    function test_commitStep_acceptsAPartialStep_atExactlyMinReplicas_andRecordsTheSet() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, EDGES);
        assertEq(c.attestations.length, 4);
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.StepCommitted(
            runId, 1, c.checkpoint, GENESIS, c.contributionsRoot, c.metricsDigest, address(this), _shardsRoot(c), EDGES
        );
        for (uint256 i = 0; i < c.attestations.length; ++i) {
            ITrainingLedger.Attestation memory a = c.attestations[i];
            vm.expectEmit(address(ledger));
            emit ITrainingLedger.ContributionAttested(
                runId, 1, _recover(c, i), a.replica, a.stage, a.contribution, a.dataShard, a.codeHash, a.lossMicros,
                a.newShard
            );
        }
        _commit(c);
        // Replica ids keep their meaning: the slots after replica 0's are replica 2's.
        assertEq(c.attestations[2].replica, 2);
        assertEq(_recover(c, 2), nodes[4]);
        assertEq(ledger.stepInfo(runId, 1).witnessHash, _witness(_signersOf(c), _shardsRoot(c), EDGES));
        (bytes32 head, uint64 step) = ledger.runHead(runId);
        assertEq(head, c.checkpoint);
        assertEq(step, 1);
    }

    function test_commitStep_acceptsFullStepsAsBefore_andSetsThatChangeFromStepToStep() public {
        uint256 runId = _create3x2();
        _commit(_nextStep(runId, ALL3));
        _commit(_nextStep(runId, 3)); // replica 2 left
        _commit(_nextStep(runId, 6)); // replica 0 left, replica 2 came back
        _commit(_nextStep(runId, ALL3)); // all back
        (, uint64 step) = ledger.runHead(runId);
        assertEq(step, 4);
    }

    function test_commitStep_recordsTheSetInTheStepCommittedEvent() public {
        uint256 runId = _create3x2();
        vm.recordLogs();
        _commit(_nextStep(runId, 6));
        Vm.Log[] memory logs = vm.getRecordedLogs();
        assertEq(logs[0].topics[0], ITrainingLedger.StepCommitted.selector);
        (,,,, bytes32 shardsRoot, uint256 replicaSet) =
            abi.decode(logs[0].data, (bytes32, bytes32, bytes32, address, bytes32, uint256));
        assertEq(replicaSet, 6);
        assertTrue(shardsRoot != bytes32(0));
        assertEq(logs.length, 1 + 4);
    }

    /// Every set of at least minReplicas of the run's replicas is accepted, and no other.
    function testFuzz_commitStep_acceptsExactlyTheSetsWithAtLeastMinReplicas(uint256 set, uint8 minSeed) public {
        uint32 minReplicas = uint32(bound(minSeed, 1, 4));
        set = bound(set, 0, 15);
        // 4 x 1: replica r is signed by key r, each its own.
        uint256 runId = _createElasticRun(4, 1, minReplicas);
        StepCall memory c = _nextStep(runId, set);
        uint256 present = _popcount(set);
        if (present < minReplicas) {
            vm.expectRevert(
                abi.encodeWithSelector(ITrainingLedger.LedgerTooFewReplicas.selector, present, minReplicas)
            );
        }
        _commit(c);
        (, uint64 step) = ledger.runHead(runId);
        assertEq(step, present < minReplicas ? 0 : 1);
    }

    /// A set with any bit at or above the run's replicas is refused, whatever else it names.
    function testFuzz_commitStep_revertsWith_ReplicaSetOutOfRange_forAnyBitAboveReplicas(uint256 set) public {
        uint256 runId = _create3x2();
        set = set | (uint256(1) << bound(set, 3, 255));
        StepCall memory c = _nextStep(runId, ALL3);
        c.replicaSet = set;
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerReplicaSetOutOfRange.selector, set, 3));
        _commit(c);
    }

    /// Removing any one attestation from a valid step names the slot that went missing.
    function testFuzz_commitStep_revertsWith_MissingStage_forAnyDroppedSlot(uint8 setSeed, uint8 dropSeed) public {
        uint256[4] memory sets = [EDGES, uint256(3), 6, ALL3];
        uint256 set = sets[setSeed % 4];
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, set);
        uint256 drop = bound(dropSeed, 0, c.attestations.length - 1);
        ITrainingLedger.Attestation memory gone = c.attestations[drop];
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerMissingStage.selector, gone.replica, gone.stage));
        _commit(_without(c, drop));
    }

    // ---------------------------------------------------------------- refused sets

    function test_commitStep_revertsWith_TooFewReplicas_belowMinReplicas() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, 2); // replica 1 alone; the run needs 2
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerTooFewReplicas.selector, 1, 2));
        _commit(c);
    }

    function test_commitStep_revertsWith_TooFewReplicas_forTheEmptySet() public {
        uint256 runId = _createElasticRun(3, 2, 1);
        StepCall memory c = _nextStep(runId, 0);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerTooFewReplicas.selector, 0, 1));
        _commit(c);
    }

    function test_commitStep_revertsWith_ReplicaSetOutOfRange_forABitAtReplicas() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, EDGES);
        c.replicaSet = EDGES | 8; // replica 3 of a 3-replica run
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerReplicaSetOutOfRange.selector, 13, 3));
        _commit(c);
    }

    function test_commitStep_revertsWith_MissingStage_whenAPresentReplicaLacksAStage() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, EDGES);
        // (0, 0), (0, 1), (2, 0), (2, 1) without (0, 1): replica 0 is present without stage 1.
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerMissingStage.selector, 0, 1));
        _commit(_without(c, 1));
    }

    function test_commitStep_revertsWith_MissingStage_whenTheSetNamesAReplicaWithoutAttestations() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, EDGES);
        c.replicaSet = ALL3; // names replica 1, whose slots are not there
        _resignAllOver(c, ALL3);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerMissingStage.selector, 1, 0));
        _commit(c);
    }

    function test_commitStep_revertsWith_ReplicaNotInSet_forAnAttestationOfAnAbsentReplica() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, EDGES);
        // Slot 2 claims replica 1 (signed over {0, 2}): the set does not name it.
        c.attestations[2] = _attestation(keys[2], runId, 1, GENESIS, 1, 0, EDGES);
        c.contributionsRoot = _root(c.attestations);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerReplicaNotInSet.selector, 1, EDGES));
        _commit(c);
    }

    function test_commitStep_revertsWith_ReplicaSetMismatch_forAnAttestationSignedOverAnotherSet() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, EDGES);
        c.attestations[3] = _attestation(keys[5], runId, 1, GENESIS, 2, 1, ALL3);
        c.contributionsRoot = _root(c.attestations);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerReplicaSetMismatch.selector, 3, EDGES, ALL3));
        _commit(c);
    }

    function test_commitStep_revertsWith_ReplicaSetMismatch_whenAFullStepIsSubmittedAsPartial() public {
        uint256 runId = _create3x2();
        // The slots of replicas 0 and 2 of a full step, signed over {0, 1, 2}, sent as {0, 2}.
        StepCall memory c = _without(_without(_nextStep(runId, ALL3), 2), 2);
        c.replicaSet = EDGES;
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerReplicaSetMismatch.selector, 0, EDGES, ALL3));
        _commit(c);
    }

    function test_commitStep_revertsWith_NotMember_whenAFullStepsSignaturesAreRelabelledAsPartial() public {
        uint256 runId = _create3x2();
        // Replicas 0 and 2's slots of a full step, their set field rewritten to {0, 2}: the
        // signatures are over {0, 1, 2}, so they recover to keys that are not members.
        StepCall memory c = _without(_without(_nextStep(runId, ALL3), 2), 2);
        for (uint256 i = 0; i < c.attestations.length; ++i) {
            c.attestations[i].replicaSet = EDGES;
        }
        c.replicaSet = EDGES;
        address recovered = _recover(c, 0);
        assertTrue(recovered != nodes[0]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotMember.selector, runId, recovered));
        _commit(c);
    }

    function test_commitStep_revertsWith_NotIndependent_namingReplicaIds_inAPartialStep() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, 6); // replicas 1 and 2
        _resign(c, 2, keys[2]); // replica 2's stage 0 signed by replica 1's stage-0 node
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotIndependent.selector, nodes[2], 1, 2));
        _commit(c);
    }

    // ---------------------------------------------------------------- challenges of partial steps

    function test_openChallenge_ofAPartialStep_holdsTheNodeOfThatReplicasSlot() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, EDGES);
        _commit(c);
        uint256 id = _challenge(c, 2, 1);
        assertEq(ledger.challenge(id).node, nodes[5]);
        assertEq(ledger.challenge(id).replica, 2);
        assertEq(registry.openChallengesOf(nodes[5]), 1);
    }

    function test_openChallenge_revertsWith_ReplicaNotInSet_forAnAbsentReplica() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, EDGES);
        _commit(c);
        address[] memory signers = _signersOf(c);
        bytes32 root = _shardsRoot(c);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerReplicaNotInSet.selector, 1, EDGES));
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 1, 0, EDGES, signers, root, bytes32(0));
    }

    function test_openChallenge_revertsWith_WitnessMismatch_forAnotherSet() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, 3);
        _commit(c);
        address[] memory signers = _signersOf(c);
        bytes32 root = _shardsRoot(c);
        // The same signers claimed for replicas {0, 2} would charge replica 2's slot to another node.
        vm.expectRevert(
            abi.encodeWithSelector(
                ITrainingLedger.LedgerWitnessMismatch.selector, _witness(signers, root, 3), _witness(signers, root, EDGES)
            )
        );
        vm.prank(verifier);
        ledger.openChallenge{value: MIN_STAKE}(runId, 1, 2, 0, EDGES, signers, root, bytes32(0));
    }

    function test_openAggregateChallenge_ofAPartialStep_holdsThePresentCoSigners_andSlashesThemWhenUpheld() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, 6);
        _commit(c);
        uint256 id = _challengeAggregate(c, 1);
        address[] memory coSigners = ledger.coSignersOf(id);
        assertEq(coSigners.length, 2);
        assertEq(coSigners[0], nodes[3]); // replica 1, stage 1
        assertEq(coSigners[1], nodes[5]); // replica 2, stage 1
        ledger.resolveChallenge(id, true, _verdicts(id, true, 2));
        assertEq(registry.stakeOf(nodes[3]), 0);
        assertEq(registry.stakeOf(nodes[5]), 0);
        assertEq(registry.stakeOf(nodes[1]), MIN_STAKE); // replica 0 was not in the step
    }

    // ---------------------------------------------------------------- equivocation across sets

    /// @dev Slot `index` of `c` signed again with another contribution over `replicaSet`.
    function _resignedOver(StepCall memory c, uint256 index, uint256 replicaSet, bytes32 contribution)
        internal
        view
        returns (ITrainingLedger.Attestation memory a)
    {
        a = c.attestations[index];
        ITrainingLedger.Attestation memory copy;
        (copy.replica, copy.stage, copy.replicaSet) = (a.replica, a.stage, replicaSet);
        (copy.contribution, copy.dataShard, copy.codeHash) = (contribution, a.dataShard, a.codeHash);
        (copy.lossMicros, copy.newShard) = (a.lossMicros, a.newShard);
        uint256 key = keys[(uint256(a.replica) * 2 + a.stage) % keys.length];
        (copy.r, copy.vs) = vm.signCompact(key, _digest(c.runId, c.step, c.parent, copy));
        return copy;
    }

    function test_reportEquivocation_revertsWith_DifferentReplicaSets_forOneSlotSignedForTwoSets() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, ALL3);
        // After a membership change replica 0 re-signs step 1 for {0, 2}: no equivocation.
        ITrainingLedger.Attestation memory b = _resignedOver(c, 0, EDGES, keccak256("redone"));
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerDifferentReplicaSets.selector, ALL3, EDGES));
        ledger.reportEquivocation(runId, 1, c.parent, c.attestations[0], b);
    }

    function test_reportEquivocation_slashes_twoContributionsForOneSlotOverOneSet() public {
        uint256 runId = _create3x2();
        StepCall memory c = _nextStep(runId, EDGES);
        ITrainingLedger.Attestation memory b = _resignedOver(c, 2, EDGES, keccak256("other"));
        vm.prank(reporter);
        uint256 slashed = ledger.reportEquivocation(runId, 1, c.parent, c.attestations[2], b);
        assertEq(slashed, MIN_STAKE);
        assertTrue(ledger.isSlashed(ledger.offenceId(0, runId, 1, 2, 0, c.parent, nodes[4])));
    }

    function test_reportResultEquivocation_revertsWith_DifferentReplicaSets_forShardsOfTwoSets() public {
        uint256 runId = _create3x2();
        StepCall memory full = _nextStep(runId, ALL3);
        StepCall memory part = _nextStep(runId, EDGES);
        ITrainingLedger.Attestation memory a = full.attestations[1];
        ITrainingLedger.Attestation memory b = part.attestations[1];
        b.newShard = keccak256("the aggregate of {0, 2}");
        (b.r, b.vs) = vm.signCompact(keys[1], _digest(runId, 1, GENESIS, b));
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerDifferentReplicaSets.selector, ALL3, EDGES));
        ledger.reportResultEquivocation(runId, 1, GENESIS, a, b);
    }

    // ---------------------------------------------------------------- gas

    /// @dev Gas of the second commit of `runId` over `set` (steady signers), every slot cold.
    function _steadyCommitGas(uint256 runId, uint256 set) internal returns (uint256) {
        _commit(_nextStep(runId, set));
        StepCall memory c = _nextStep(runId, set);
        vm.cool(address(ledger));
        vm.cool(address(registry));
        _commit(c);
        return vm.lastCallGas().gasTotalUsed;
    }

    /// A step of two replicas of four costs what a full step of a two-replica run does: the
    /// set walk is a few comparisons per slot and one bit scan per replica.
    function test_gas_commitStep_aPartialStep_costsAboutAFullStepWithAsManySlots() public {
        uint256 full = _steadyCommitGas(_createElasticRun(2, 2, 2), 3);
        uint256 partial_ = _steadyCommitGas(_createElasticRun(4, 2, 2), 10); // replicas 1 and 3
        emit log_named_uint("commitStep, 2 x 2, full set, steady", full);
        emit log_named_uint("commitStep, 2 of 4 replicas x 2, steady", partial_);
        assertLe(partial_, full + 1_000);
    }

    // ---------------------------------------------------------------- helpers

    /// @dev Re-signs every attestation of `c` over `replicaSet` (with that field set).
    function _resignAllOver(StepCall memory c, uint256 replicaSet) internal view {
        for (uint256 i = 0; i < c.attestations.length; ++i) {
            ITrainingLedger.Attestation memory a = c.attestations[i];
            a.replicaSet = replicaSet;
            uint256 key = keys[(uint256(a.replica) * 2 + a.stage) % keys.length];
            (a.r, a.vs) = vm.signCompact(key, _digest(c.runId, c.step, c.parent, a));
        }
    }
}
