// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {ECDSA} from "@openzeppelin/contracts/utils/cryptography/ECDSA.sol";

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {ITrainingLedger} from "../src/interfaces/ITrainingLedger.sol";
import {LedgerFixture} from "./utils/LedgerFixture.sol";

contract TrainingLedgerTest is LedgerFixture {
    // ---------------------------------------------------------------- constructor and domain

    function test_constructor_setsRegistry_andEip712Domain() public view {
        assertEq(ledger.registry(), address(registry));
        assertEq(ledger.runCount(), 0);
        assertEq(ledger.CONTRIBUTION_TYPEHASH(), CONTRIBUTION_TYPEHASH);

        (, string memory name, string memory version, uint256 chainId, address verifyingContract,,) =
            ledger.eip712Domain();
        assertEq(name, "DiLoCoXLedger");
        assertEq(version, "3");
        assertEq(chainId, block.chainid);
        assertEq(verifyingContract, address(ledger));
    }

    // ---------------------------------------------------------------- contributionDigest

    function _manualDigest(
        address verifyingContract,
        uint256 runId,
        uint64 step,
        bytes32 parent,
        ITrainingLedger.Attestation memory a
    ) internal view returns (bytes32) {
        bytes32 domainSeparator = keccak256(
            abi.encode(DOMAIN_TYPEHASH, keccak256("DiLoCoXLedger"), keccak256("3"), block.chainid, verifyingContract)
        );
        bytes32 structHash = keccak256(
            bytes.concat(
                abi.encode(CONTRIBUTION_TYPEHASH, runId, step, a.replica, a.stage, a.replicaSet),
                abi.encode(parent, a.contribution, a.dataShard, a.codeHash, a.lossMicros, a.newShard)
            )
        );
        return keccak256(abi.encodePacked(hex"1901", domainSeparator, structHash));
    }

    function test_contributionDigest_equalsEip712DigestComputedFromTypehashAndDomain() public view {
        ITrainingLedger.Attestation memory a = _attestation(keys[0], 7, 3, keccak256("parent"), 1, 0);
        a.lossMicros = -1_234_567;
        assertEq(_digest(7, 3, keccak256("parent"), a), _manualDigest(address(ledger), 7, 3, keccak256("parent"), a));
    }

    function testFuzz_contributionDigest_equalsManualDigest(
        uint256 runId,
        uint64 step,
        uint32 replica,
        uint32 stage,
        bytes32 parent,
        bytes32 contribution,
        int64 lossMicros
    ) public view {
        ITrainingLedger.Attestation memory a;
        a.replica = replica;
        a.stage = stage;
        a.contribution = contribution;
        a.dataShard = keccak256(abi.encode(contribution));
        a.codeHash = CODE;
        a.lossMicros = lossMicros;
        a.newShard = keccak256(abi.encode(parent, stage));
        assertEq(_digest(runId, step, parent, a), _manualDigest(address(ledger), runId, step, parent, a));
    }

    // ---------------------------------------------------------------- createRun

    function test_createRun_storesRun_andEmitsRunCreated() public {
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.RunCreated(
            1, address(this), CONFIG, GENESIS, 2, 2, 2, nodes, ITrainingLedger.Independence.Keys
        );
        uint256 runId = _createRun();

        assertEq(runId, 1);
        assertEq(ledger.runCount(), 1);
        (bytes32 head, uint64 step) = ledger.runHead(runId);
        assertEq(head, GENESIS);
        assertEq(step, 0);
        assertEq(ledger.stepCheckpoint(runId, 0), GENESIS);
        assertEq(ledger.stepCheckpoint(runId, 1), bytes32(0));
        for (uint256 i = 0; i < nodes.length; ++i) {
            assertTrue(ledger.isMember(runId, nodes[i]));
        }
        assertFalse(ledger.isMember(runId, submitter));
        assertFalse(ledger.isMember(2, nodes[0]));
    }

    function test_createRun_assignsIncreasingIds_startingAtOne() public {
        assertEq(_createRun(), 1);
        assertEq(_createRun(), 2);
        assertEq(_createRun(), 3);
        assertEq(ledger.runCount(), 3);
    }

    function test_createRun_acceptsZeroQuorum_whenThereAreNoArbiters() public {
        uint256 runId = ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 1, 1, 1, 0, 0, new address[](0), 0, 0));
        assertEq(runId, 1);
    }

    function test_createRun_revertsWith_InvalidShape_whenReplicasIsZero() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidShape.selector, 0, 2));
        _createRun(0, 2, MIN_STAKE);
    }

    function test_createRun_revertsWith_InvalidShape_whenStagesIsZero() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidShape.selector, 2, 0));
        _createRun(2, 0, MIN_STAKE);
    }

    function test_createRun_revertsWith_NoNodes_whenNodeListIsEmpty() public {
        vm.expectRevert(ITrainingLedger.LedgerNoNodes.selector);
        ledger.createRun(_runSpec(CONFIG, GENESIS, new address[](0), 2, 2, 2, WINDOW, MIN_STAKE, arbiters, 2, 0));
    }

    function test_createRun_revertsWith_DuplicateNode_whenANodeIsListedTwice() public {
        nodes.push(nodes[1]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerDuplicateNode.selector, nodes[1]));
        _createRun();
    }

    function test_createRun_revertsWith_InvalidQuorum_whenQuorumExceedsArbiters() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidQuorum.selector, 4, 3));
        ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, WINDOW, MIN_STAKE, arbiters, 4, 0));
    }

    function test_createRun_revertsWith_InvalidQuorum_whenQuorumIsZeroWithArbiters() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidQuorum.selector, 0, 3));
        ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, WINDOW, MIN_STAKE, arbiters, 0, 0));
    }

    function test_createRun_revertsWith_ZeroDigest_whenGenesisIsZero() public {
        vm.expectRevert(ITrainingLedger.LedgerZeroDigest.selector);
        ledger.createRun(_runSpec(CONFIG, bytes32(0), nodes, 2, 2, 2, WINDOW, MIN_STAKE, arbiters, 2, 0));
    }

    // ---------------------------------------------------------------- views on unknown runs

    function test_runHead_revertsWith_UnknownRun_whenRunDoesNotExist() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownRun.selector, 1));
        ledger.runHead(1);
    }

    function test_stepCheckpoint_revertsWith_UnknownRun_whenRunDoesNotExist() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownRun.selector, 0));
        ledger.stepCheckpoint(0, 0);
    }

    // ---------------------------------------------------------------- commitStep: success

    function test_commitStep_movesHead_andRecordsCheckpoint() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);

        vm.prank(submitter);
        _commit(c);

        (bytes32 head, uint64 step) = ledger.runHead(runId);
        assertEq(head, c.checkpoint);
        assertEq(step, 1);
        assertEq(ledger.stepCheckpoint(runId, 1), c.checkpoint);
        assertEq(ledger.stepCheckpoint(runId, 0), GENESIS);
    }

    function test_commitStep_emitsStepCommitted_thenOneContributionAttestedPerSlot() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);

        vm.expectEmit(address(ledger));
        emit ITrainingLedger.StepCommitted(
            runId, 1, c.checkpoint, GENESIS, c.contributionsRoot, c.metricsDigest, submitter, _shardsRoot(c), 3
        );
        for (uint256 i = 0; i < c.attestations.length; ++i) {
            ITrainingLedger.Attestation memory a = c.attestations[i];
            vm.expectEmit(address(ledger));
            emit ITrainingLedger.ContributionAttested(
                runId,
                1,
                nodes[i],
                a.replica,
                a.stage,
                a.contribution,
                a.dataShard,
                a.codeHash,
                a.lossMicros,
                a.newShard
            );
        }
        vm.prank(submitter);
        _commit(c);
    }

    function test_commitStep_chainsSteps_whenEachParentIsThePreviousCheckpoint() public {
        uint256 runId = _createRun();
        bytes32[4] memory checkpoints;
        for (uint256 i = 1; i < 4; ++i) {
            StepCall memory c = _nextStep(runId);
            _commit(c);
            checkpoints[i] = c.checkpoint;
        }
        (bytes32 head, uint64 step) = ledger.runHead(runId);
        assertEq(step, 3);
        assertEq(head, checkpoints[3]);
        for (uint64 i = 1; i < 4; ++i) {
            assertEq(ledger.stepCheckpoint(runId, i), checkpoints[i]);
        }
    }

    function test_commitStep_acceptsOneNodeSigningSeveralStagesOfItsReplica() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        _resign(c, 1, keys[0]);
        _commit(c);
        assertEq(ledger.stepCheckpoint(runId, 1), c.checkpoint);
    }

    function test_commitStep_keepsRunsApart() public {
        uint256 first = _createRun();
        uint256 second = _createRun();
        _commit(_nextStep(second));
        (, uint64 firstStep) = ledger.runHead(first);
        (, uint64 secondStep) = ledger.runHead(second);
        assertEq(firstStep, 0);
        assertEq(secondStep, 1);
    }

    function testFuzz_commitStep_acceptsAnyShape(uint32 replicas, uint32 stages) public {
        replicas = uint32(bound(replicas, 1, 3));
        stages = uint32(bound(stages, 1, 3));
        // One key per slot, so the replicas are independent.
        for (uint256 i = nodes.length; i < uint256(replicas) * stages; ++i) {
            _addStakedNode(string.concat("extra", vm.toString(i)), MIN_STAKE);
        }
        uint256 runId = _createRun(replicas, stages, MIN_STAKE);
        _shapes[runId] = [replicas, stages];

        StepCall memory c = _nextStep(runId);
        assertEq(c.attestations.length, uint256(replicas) * stages);
        _commit(c);
        (bytes32 head, uint64 step) = ledger.runHead(runId);
        assertEq(head, c.checkpoint);
        assertEq(step, 1);
    }

    // ---------------------------------------------------------------- commitStep: reverts

    function test_commitStep_revertsWith_UnknownRun_whenRunDoesNotExist() public {
        StepCall memory c = _nextStep(_createRun());
        c.runId = 2;
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownRun.selector, 2));
        _commit(c);
    }

    function test_commitStep_revertsWith_WrongStep_whenStepSkipsAhead() public {
        StepCall memory c = _nextStep(_createRun());
        c.step = 2;
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWrongStep.selector, 1, 2));
        _commit(c);
    }

    function test_commitStep_revertsWith_WrongStep_whenStepIsReplayed() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        _commit(c);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWrongStep.selector, 2, 1));
        _commit(c);
    }

    function test_commitStep_revertsWith_StaleParent_whenParentIsNotHead() public {
        StepCall memory c = _nextStep(_createRun());
        c.parent = keccak256("stale");
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStaleParent.selector, GENESIS, c.parent));
        _commit(c);
    }

    function test_commitStep_revertsWith_ZeroDigest_whenCheckpointIsZero() public {
        StepCall memory c = _nextStep(_createRun());
        c.checkpoint = bytes32(0);
        vm.expectRevert(ITrainingLedger.LedgerZeroDigest.selector);
        _commit(c);
    }

    function test_commitStep_revertsWith_MissingStage_whenTheLastSlotIsMissing() public {
        StepCall memory c = _nextStep(_createRun());
        ITrainingLedger.Attestation[] memory attestations = c.attestations;
        assembly ("memory-safe") {
            mstore(attestations, 3)
        }
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerMissingStage.selector, 1, 1));
        _commit(c);
    }

    function test_commitStep_revertsWith_WrongAttestationCount_whenThereIsOneSlotTooMany() public {
        StepCall memory c = _nextStep(_createRun());
        ITrainingLedger.Attestation[] memory five = new ITrainingLedger.Attestation[](5);
        for (uint256 i = 0; i < 4; ++i) {
            five[i] = c.attestations[i];
        }
        five[4] = c.attestations[3];
        c.attestations = five;
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWrongAttestationCount.selector, 4, 5));
        _commit(c);
    }

    function test_commitStep_revertsWith_SlotOutOfOrder_whenSlotsAreSwapped() public {
        StepCall memory c = _nextStep(_createRun());
        (c.attestations[1], c.attestations[2]) = (c.attestations[2], c.attestations[1]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerSlotOutOfOrder.selector, 1, 1, 0));
        _commit(c);
    }

    function test_commitStep_revertsWith_SlotOutOfOrder_whenASlotIsRepeated() public {
        StepCall memory c = _nextStep(_createRun());
        c.attestations[3] = c.attestations[2];
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerSlotOutOfOrder.selector, 3, 1, 0));
        _commit(c);
    }

    function test_commitStep_revertsWith_SlotOutOfOrder_whenStageIsOutOfRange() public {
        StepCall memory c = _nextStep(_createRun());
        // replica 0, stage 3 would be slot 3 if stages were unbounded.
        c.attestations[3].replica = 0;
        c.attestations[3].stage = 3;
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerSlotOutOfOrder.selector, 3, 0, 3));
        _commit(c);
    }

    function test_commitStep_revertsWith_ReplicaNotInSet_whenReplicaIsOutOfRange() public {
        StepCall memory c = _nextStep(_createRun());
        c.attestations[3].replica = 2;
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerReplicaNotInSet.selector, 2, 3));
        _commit(c);
    }

    function test_commitStep_revertsWith_NotMember_whenSignerIsNotInTheRun() public {
        StepCall memory c = _nextStep(_createRun());
        (address outsider, uint256 outsiderKey) = _addStakedNode("outsider", MIN_STAKE);
        _resign(c, 2, outsiderKey);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotMember.selector, 1, outsider));
        _commit(c);
    }

    function test_commitStep_revertsWith_NotMember_whenAFieldIsChangedAfterSigning() public {
        StepCall memory c = _nextStep(_createRun());
        c.attestations[1].lossMicros -= 1;
        address recovered = _recover(c, 1);
        assertTrue(recovered != nodes[1]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotMember.selector, 1, recovered));
        _commit(c);
    }

    function test_commitStep_revertsWith_NotMember_whenSignatureIsForAnotherRun() public {
        uint256 first = _createRun();
        uint256 second = _createRun();
        StepCall memory c = _nextStep(second);
        c.runId = first;
        address recovered = _recover(c, 0);
        assertTrue(recovered != nodes[0]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotMember.selector, first, recovered));
        _commit(c);
    }

    function test_commitStep_revertsWith_NotMember_whenSignatureIsForAnotherLedger() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);

        TrainingLedger other = new TrainingLedger(registry);
        ITrainingLedger.Attestation memory a = c.attestations[0];
        bytes32 otherDigest = other.contributionDigest(runId, c.step, c.parent, a);
        assertEq(otherDigest, _manualDigest(address(other), runId, c.step, c.parent, a));
        assertTrue(otherDigest != _digest(runId, c.step, c.parent, a));
        (a.r, a.vs) = vm.signCompact(keys[0], otherDigest);

        address recovered = _recover(c, 0);
        assertTrue(recovered != nodes[0]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotMember.selector, runId, recovered));
        _commit(c);
    }

    function test_commitStep_revertsWith_ECDSAInvalidSignatureS_whenSignatureIsMalformed() public {
        StepCall memory c = _nextStep(_createRun());
        c.attestations[0].vs = bytes32(type(uint256).max); // s above n / 2: malleable, refused
        vm.expectRevert(abi.encodeWithSelector(ECDSA.ECDSAInvalidSignatureS.selector, bytes32(type(uint256).max >> 1)));
        _commit(c);
    }

    function test_commitStep_revertsWith_InsufficientStake_whenMemberStakesBelowMinimum() public {
        (address poor, uint256 poorKey) = _addStakedNode("poor", MIN_STAKE - 1);
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        _resign(c, 0, poorKey);
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientStake.selector, poor, MIN_STAKE - 1, MIN_STAKE)
        );
        _commit(c);
    }

    function test_commitStep_revertsWith_InsufficientStake_whenMemberHasNoStakeAndMinimumIsZero() public {
        (address unstaked, uint256 unstakedKey) = _addStakedNode("unstaked", 0);
        uint256 runId = _createRun(2, 2, 0);
        StepCall memory c = _nextStep(runId);
        _resign(c, 2, unstakedKey);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientStake.selector, unstaked, 0, 1));
        _commit(c);
    }

    function testFuzz_commitStep_requiresStakeAtLeastMinimum(uint256 staked, uint256 minStake) public {
        staked = bound(staked, 1, 100 ether);
        minStake = bound(minStake, 0, 100 ether);
        (address node, uint256 key) = _addStakedNode("fuzzed", staked);
        uint256 runId = _createRun(2, 2, minStake);
        StepCall memory c = _nextStep(runId);
        _resign(c, 1, key);
        // The four setUp nodes stake MIN_STAKE each; keep them eligible.
        for (uint256 i = 0; i < 4; ++i) {
            if (minStake > MIN_STAKE) {
                vm.deal(address(this), minStake);
                registry.stake{value: minStake}(nodes[i]);
            }
        }
        if (staked < minStake) {
            vm.expectRevert(
                abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientStake.selector, node, staked, minStake)
            );
        }
        _commit(c);
    }

    function test_commitStep_revertsWith_ContributionsRootMismatch_whenRootDoesNotHashContributions() public {
        StepCall memory c = _nextStep(_createRun());
        bytes32 expected = c.contributionsRoot;
        c.contributionsRoot = keccak256("wrong root");
        vm.expectRevert(
            abi.encodeWithSelector(
                ITrainingLedger.LedgerContributionsRootMismatch.selector, expected, c.contributionsRoot
            )
        );
        _commit(c);
    }

    function test_commitStep_revertsWith_ContributionsRootMismatch_whenRootIsInAnotherOrder() public {
        StepCall memory c = _nextStep(_createRun());
        bytes32 expected = c.contributionsRoot;
        c.contributionsRoot = keccak256(
            abi.encodePacked(
                c.attestations[1].contribution,
                c.attestations[0].contribution,
                c.attestations[2].contribution,
                c.attestations[3].contribution
            )
        );
        vm.expectRevert(
            abi.encodeWithSelector(
                ITrainingLedger.LedgerContributionsRootMismatch.selector, expected, c.contributionsRoot
            )
        );
        _commit(c);
    }
}
