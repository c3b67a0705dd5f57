// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {INodeRegistry} from "../src/interfaces/INodeRegistry.sol";
import {ITrainingLedger} from "../src/interfaces/ITrainingLedger.sol";
import {LedgerFixture} from "./utils/LedgerFixture.sol";

/// @notice Replicas as independent witnesses: the independence rule (keys or operators), the
/// co-signed stage shards, result equivocation, and aggregate challenges that slash every
/// co-signer of a wrong shard at once.
contract LedgerWitnessesTest is LedgerFixture {
    address internal reporter = makeAddr("reporter");

    function _stakeTotal(address node) internal view returns (uint256) {
        (uint256 unbonding,) = registry.unbondingOf(node);
        return registry.stakeOf(node) + unbonding;
    }

    function _assertAccounting() internal view {
        assertEq(address(registry).balance, registry.totalStaked() + registry.totalBonds() + registry.totalCredits() + registry.totalPools());
    }

    /// @dev Slot `slot` of `c` with its new shard replaced by `shard`, signed by `key`.
    function _withShard(StepCall memory c, uint256 slot, bytes32 shard, uint256 key)
        internal
        view
        returns (ITrainingLedger.Attestation memory a)
    {
        a = c.attestations[slot];
        ITrainingLedger.Attestation memory copy;
        copy.replica = a.replica;
        copy.stage = a.stage;
        copy.replicaSet = a.replicaSet;
        copy.contribution = a.contribution;
        copy.dataShard = a.dataShard;
        copy.codeHash = a.codeHash;
        copy.lossMicros = a.lossMicros;
        copy.newShard = shard;
        (copy.r, copy.vs) = vm.signCompact(key, _digest(c.runId, c.step, c.parent, copy));
        return copy;
    }

    /// @dev Registers and stakes a second node key of node0's operator, a member of new runs.
    function _addSecondNodeOfOperator0() internal returns (address node, uint256 key) {
        (node, key) = makeAddrAndKey("node0-second");
        vm.prank(node);
        registry.register(_operatorOf("node0"));
        vm.deal(_operatorOf("node0"), MIN_STAKE);
        vm.prank(_operatorOf("node0"));
        registry.stake{value: MIN_STAKE}(node);
        nodes.push(node);
        keys.push(key);
    }

    // ---------------------------------------------------------------- createRun

    function test_createRun_storesTheIndependenceMode_andEmitsIt() public {
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.RunCreated(
            1, address(this), CONFIG, GENESIS, 2, 2, 2, nodes, ITrainingLedger.Independence.Operators
        );
        uint256 runId = _createOperatorRun();
        assertEq(uint8(ledger.independenceOf(runId)), uint8(ITrainingLedger.Independence.Operators));
        assertEq(uint8(ledger.independenceOf(_createRun())), uint8(ITrainingLedger.Independence.Keys));
    }

    function testFuzz_createRun_revertsWith_InvalidIndependence_forAnUnknownMode(uint8 mode) public {
        mode = uint8(bound(mode, 2, type(uint8).max));
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerInvalidIndependence.selector, mode));
        ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, WINDOW, MIN_STAKE, arbiters, 2, mode));
    }

    function test_independenceOf_revertsWith_UnknownRun() public {
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownRun.selector, 9));
        ledger.independenceOf(9);
    }

    // ---------------------------------------------------------------- independence

    function test_commitStep_revertsWith_NotIndependent_whenANodeSignsSlotsOfTwoReplicas() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        _resign(c, 3, keys[1]); // node1 holds (0, 1) and now (1, 1)
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotIndependent.selector, nodes[1], 0, 1));
        _commit(c);
    }

    function test_commitStep_revertsWith_NotIndependent_evenWhenTheSignerListWasCachedBefore() public {
        uint256 runId = _createRun();
        _commitNext(runId);
        StepCall memory c = _nextStep(runId);
        _resign(c, 2, keys[0]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotIndependent.selector, nodes[0], 0, 1));
        _commit(c);
    }

    function testFuzz_commitStep_refusesAnyNodeInTwoReplicas(uint8 first, uint8 second) public {
        // A 3 x 2 run, one key per slot; then slot `second` (a later replica) re-signed by
        // the node of slot `first` (an earlier replica).
        for (uint256 i = nodes.length; i < 6; ++i) {
            _addStakedNode(string.concat("extra", vm.toString(i)), MIN_STAKE);
        }
        uint256 runId = _createRun(3, 2, MIN_STAKE);
        _shapes[runId] = [uint32(3), uint32(2)];
        uint256 a = bound(first, 0, 3);
        uint256 b = bound(second, (a / 2 + 1) * 2, 5);
        StepCall memory c = _nextStep(runId);
        _resign(c, b, keys[a]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotIndependent.selector, nodes[a], a / 2, b / 2));
        _commit(c);
    }

    function test_commitStep_operatorRun_revertsWith_NotIndependent_whenOneOperatorsNodesSignTwoReplicas() public {
        (address second, uint256 secondKey) = _addSecondNodeOfOperator0();
        uint256 runId = _createOperatorRun();
        StepCall memory c = _nextStep(runId);
        _resign(c, 2, secondKey); // node0 (replica 0) and node0-second (replica 1): one operator
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotIndependent.selector, second, 0, 1));
        _commit(c);
    }

    function test_commitStep_keysRun_acceptsTwoNodesOfOneOperatorInTwoReplicas() public {
        (, uint256 secondKey) = _addSecondNodeOfOperator0();
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        _resign(c, 2, secondKey);
        _commit(c);
        assertEq(ledger.stepCheckpoint(runId, 1), c.checkpoint);
    }

    function test_commitStep_operatorRun_acceptsOneOperatorsNodesWithinOneReplica() public {
        (, uint256 secondKey) = _addSecondNodeOfOperator0();
        uint256 runId = _createOperatorRun();
        StepCall memory c = _nextStep(runId);
        _resign(c, 1, secondKey); // both of replica 0's stages: node0 and node0-second
        _commit(c);
        assertEq(ledger.stepCheckpoint(runId, 1), c.checkpoint);
    }

    // ---------------------------------------------------------------- co-signed shards

    function test_commitStep_revertsWith_ShardMismatch_whenAReplicaCoSignsAnotherShard() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        bytes32 expected = c.attestations[1].newShard;
        c.attestations[3] = _withShard(c, 3, keccak256("other shard"), keys[3]);
        vm.expectRevert(
            abi.encodeWithSelector(
                ITrainingLedger.LedgerShardMismatch.selector, 1, 1, expected, keccak256("other shard")
            )
        );
        _commit(c);
    }

    function testFuzz_commitStep_revertsWith_ShardMismatch_forAnyDisagreement(bytes32 shard, uint8 slotSeed) public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        uint256 slot = bound(slotSeed, 2, 3);
        bytes32 expected = c.attestations[slot - 2].newShard;
        vm.assume(shard != expected);
        c.attestations[slot] = _withShard(c, slot, shard, keys[slot]);
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerShardMismatch.selector, slot - 2, 1, expected, shard)
        );
        _commit(c);
    }

    function test_commitStep_recordsTheShardsRootInItsEventAndWitnessHash() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        bytes32 root = keccak256(abi.encodePacked(c.attestations[0].newShard, c.attestations[1].newShard));
        assertEq(root, _shardsRoot(c));
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.StepCommitted(
            runId, 1, c.checkpoint, GENESIS, c.contributionsRoot, c.metricsDigest, address(this), root, 3
        );
        _commit(c);
        bytes20 witness = bytes20(keccak256(abi.encode(keccak256(abi.encodePacked(_signersOf(c))), root, 3)));
        assertEq(ledger.stepInfo(runId, 1).witnessHash, witness);
    }

    // ---------------------------------------------------------------- result equivocation

    function test_reportResultEquivocation_slashesTheNode_andEmits() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        ITrainingLedger.Attestation memory b = _withShard(c, 1, keccak256("wrong"), keys[1]);
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.ResultEquivocationSlashed(
            runId, 1, nodes[1], 1, c.parent, c.attestations[1].newShard, keccak256("wrong"), reporter
        );
        vm.prank(reporter);
        uint256 slashed = ledger.reportResultEquivocation(runId, 1, c.parent, c.attestations[1], b);
        assertEq(slashed, MIN_STAKE);
        assertEq(_stakeTotal(nodes[1]), 0);
        assertEq(registry.creditOf(reporter), MIN_STAKE / 2);
        bytes32 offence = ledger.offenceId(3, runId, 1, type(uint32).max, 1, c.parent, nodes[1]);
        assertTrue(ledger.isSlashed(offence));
        _assertAccounting();
    }

    function test_reportResultEquivocation_coversTwoReplicasOfOneStage() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        // node0 signs stage 0 of replica 0 with one shard and of replica 1 with another.
        ITrainingLedger.Attestation memory b = _withShard(c, 2, keccak256("wrong"), keys[0]);
        ledger.reportResultEquivocation(runId, 1, c.parent, c.attestations[0], b);
        assertEq(_stakeTotal(nodes[0]), 0);
    }

    function test_reportResultEquivocation_revertsWith_AlreadySlashed_onTheSecondProof() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        ITrainingLedger.Attestation memory b = _withShard(c, 0, keccak256("b"), keys[0]);
        ITrainingLedger.Attestation memory d = _withShard(c, 2, keccak256("d"), keys[0]);
        ledger.reportResultEquivocation(runId, 1, c.parent, c.attestations[0], b);
        bytes32 offence = ledger.offenceId(3, runId, 1, type(uint32).max, 0, c.parent, nodes[0]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerAlreadySlashed.selector, offence, nodes[0]));
        ledger.reportResultEquivocation(runId, 1, c.parent, b, d);
    }

    function test_reportResultEquivocation_revertsWith_DifferentStages() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerDifferentStages.selector, 0, 1));
        ledger.reportResultEquivocation(runId, 1, c.parent, c.attestations[0], c.attestations[1]);
    }

    function test_reportResultEquivocation_revertsWith_SameShard() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        bytes32 shard = c.attestations[0].newShard;
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerSameShard.selector, shard));
        ledger.reportResultEquivocation(runId, 1, c.parent, c.attestations[0], c.attestations[2]);
    }

    function test_reportResultEquivocation_revertsWith_SignerMismatch_forTwoNodes() public {
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        ITrainingLedger.Attestation memory b = _withShard(c, 2, keccak256("wrong"), keys[2]);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerSignerMismatch.selector, nodes[0], nodes[2]));
        ledger.reportResultEquivocation(runId, 1, c.parent, c.attestations[0], b);
    }

    function test_reportResultEquivocation_revertsWith_NotMember_forAnOutsider() public {
        uint256 runId = _createRun();
        (address outsider, uint256 outsiderKey) = makeAddrAndKey("outsider");
        StepCall memory c = _nextStep(runId);
        ITrainingLedger.Attestation memory a = _withShard(c, 0, keccak256("a"), outsiderKey);
        ITrainingLedger.Attestation memory b = _withShard(c, 0, keccak256("b"), outsiderKey);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNotMember.selector, runId, outsider));
        ledger.reportResultEquivocation(runId, 1, c.parent, a, b);
    }

    function test_reportResultEquivocation_revertsWith_UnknownRun() public {
        StepCall memory c = _nextStep(_createRun());
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownRun.selector, 5));
        ledger.reportResultEquivocation(5, 1, c.parent, c.attestations[0], c.attestations[2]);
    }

    function testFuzz_reportResultEquivocation_slashesAnyTwoDifferentShards(bytes32 x, bytes32 y, uint8 slot) public {
        vm.assume(x != y);
        uint256 runId = _createRun();
        StepCall memory c = _nextStep(runId);
        uint256 i = bound(slot, 0, 3);
        ITrainingLedger.Attestation memory a = _withShard(c, i, x, keys[i]);
        ITrainingLedger.Attestation memory b = _withShard(c, i, y, keys[i]);
        assertEq(ledger.reportResultEquivocation(runId, 1, c.parent, a, b), MIN_STAKE);
        assertEq(_stakeTotal(nodes[i]), 0);
        _assertAccounting();
    }

    // ---------------------------------------------------------------- aggregate challenges

    function test_openAggregateChallenge_holdsEveryCoSigner_andEmits() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory coSigners = new address[](2);
        (coSigners[0], coSigners[1]) = (nodes[1], nodes[3]);
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.ChallengeOpened(1, runId, 1, nodes[1], 0, 0, 1, verifier, MIN_STAKE, keccak256("evidence"));
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.AggregateChallenged(1, 1, c.attestations[1].newShard, coSigners);
        vm.expectEmit(address(registry));
        emit INodeRegistry.BondHeld(nodes[1], MIN_STAKE);
        vm.expectEmit(address(registry));
        emit INodeRegistry.NodeHeld(nodes[3]);
        uint256 id = _challengeAggregate(c, 1);
        ITrainingLedger.Challenge memory stored = ledger.challenge(id);
        assertTrue(stored.aggregate);
        assertEq(stored.node, nodes[1]);
        assertEq(stored.stage, 1);
        assertEq(ledger.coSignersOf(id), coSigners);
        assertEq(registry.openChallengesOf(nodes[1]), 1);
        assertEq(registry.openChallengesOf(nodes[3]), 1);
        assertEq(registry.openChallengesOf(nodes[0]), 0);
        assertEq(ledger.stepInfo(runId, 1).openChallenges, 1);
        _assertAccounting();
    }

    function test_resolveChallenge_upheldAggregate_slashesEveryCoSigner_andRollsBack() public {
        uint256 runId = _createRun();
        _commitNext(runId);
        StepCall memory c = _commitNext(runId);
        uint256 id = _challengeAggregate(c, 0);
        vm.expectEmit(address(registry));
        emit INodeRegistry.Slashed(nodes[0], verifier, MIN_STAKE, MIN_STAKE / 2);
        vm.expectEmit(address(registry));
        emit INodeRegistry.Slashed(nodes[2], verifier, MIN_STAKE, MIN_STAKE / 2);
        ledger.resolveChallenge(id, true, _verdicts(id, true, 2));
        assertEq(_stakeTotal(nodes[0]), 0);
        assertEq(_stakeTotal(nodes[2]), 0);
        assertEq(_stakeTotal(nodes[1]), MIN_STAKE);
        assertEq(registry.openChallengesOf(nodes[0]), 0);
        assertEq(registry.openChallengesOf(nodes[2]), 0);
        (, uint64 headStep) = ledger.runHead(runId);
        assertEq(headStep, 1);
        assertTrue(ledger.stepInfo(runId, 2).rejected);
        for (uint32 r = 0; r < 2; ++r) {
            assertTrue(ledger.isSlashed(ledger.offenceId(2, runId, 2, r, 0, bytes32(0), nodes[2 * r])));
        }
        _assertAccounting();
    }

    function test_resolveChallenge_dismissedAggregate_paysTheFirstCoSignersOperator_andReleasesAll() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        uint256 id = _challengeAggregate(c, 1);
        vm.expectEmit(address(registry));
        emit INodeRegistry.NodeReleased(nodes[3]);
        ledger.resolveChallenge(id, false, _verdicts(id, false, 2));
        assertEq(registry.creditOf(_operatorOf("node1")), MIN_STAKE);
        assertEq(registry.openChallengesOf(nodes[1]), 0);
        assertEq(registry.openChallengesOf(nodes[3]), 0);
        assertEq(_stakeTotal(nodes[1]) + _stakeTotal(nodes[3]), 2 * MIN_STAKE);
        _assertAccounting();
    }

    function test_resolveChallenge_aSecondUpheldAggregateOnTheSameRecord_slashesNobodyAgain() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        uint256 first = _challengeAggregate(c, 0);
        uint256 second = _challengeAggregate(c, 0);
        ledger.resolveChallenge(first, true, _verdicts(first, true, 2));
        vm.expectEmit(address(ledger));
        emit ITrainingLedger.ChallengeResolved(second, runId, 1, nodes[0], true, false);
        ledger.resolveChallenge(second, true, _verdicts(second, true, 2));
        _assertAccounting();
    }

    function test_expireChallenge_releasesEveryCoSigner_andRefundsTheChallenger() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        uint256 id = _challengeAggregate(c, 0);
        vm.warp(block.timestamp + ledger.resolutionPeriod() + 1);
        ledger.expireChallenge(id);
        assertEq(registry.openChallengesOf(nodes[0]), 0);
        assertEq(registry.openChallengesOf(nodes[2]), 0);
        assertEq(registry.creditOf(verifier), MIN_STAKE);
        _assertAccounting();
    }

    function test_withdraw_waitsForAnAggregateChallenge_forEveryCoSigner() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        vm.prank(_operatorOf("node2"));
        registry.unbond(nodes[2]);
        _challengeAggregate(c, 0);
        (, uint64 releaseAt) = registry.unbondingOf(nodes[2]);
        vm.warp(releaseAt);
        vm.expectRevert(abi.encodeWithSelector(INodeRegistry.RegistryUnderChallenge.selector, nodes[2], 1));
        vm.prank(_operatorOf("node2"));
        registry.withdraw(nodes[2]);
    }

    function test_openAggregateChallenge_revertsWith_NoArbiters_whenTheRunHasNone() public {
        uint256 runId = ledger.createRun(_runSpec(CONFIG, GENESIS, nodes, 2, 2, 2, WINDOW, MIN_STAKE, new address[](0), 0, 0));
        StepCall memory c = _commitNext(runId);
        (address[] memory signers, bytes32[] memory shards) = (_signersOf(c), _shardsOf(c));
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerNoArbiters.selector, runId));
        vm.prank(verifier);
        ledger.openAggregateChallenge{value: MIN_STAKE}(runId, 1, 0, _fullSet(2), signers, shards, bytes32(0));
    }

    function test_openAggregateChallenge_revertsWith_SlotOutOfRange_forAStageOutsideTheShape() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        (address[] memory signers, bytes32[] memory shards) = (_signersOf(c), _shardsOf(c));
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerSlotOutOfRange.selector, runId, 0, 2));
        vm.prank(verifier);
        ledger.openAggregateChallenge{value: MIN_STAKE}(runId, 1, 2, _fullSet(2), signers, shards, bytes32(0));
    }

    function test_openAggregateChallenge_revertsWith_WitnessMismatch_forOtherShards() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        bytes32[] memory shards = _shardsOf(c);
        bytes20 expected = _witness(signers, _shardsRoot(c), 3);
        shards[1] = keccak256("forged");
        bytes20 got = _witness(signers, keccak256(abi.encodePacked(shards)), 3);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWitnessMismatch.selector, expected, got));
        vm.prank(verifier);
        ledger.openAggregateChallenge{value: MIN_STAKE}(runId, 1, 0, _fullSet(2), signers, shards, bytes32(0));
    }

    function test_openAggregateChallenge_revertsWith_InsufficientBond() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        address[] memory signers = _signersOf(c);
        bytes32[] memory shards = _shardsOf(c);
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientBond.selector, MIN_STAKE, MIN_STAKE - 1)
        );
        vm.prank(verifier);
        ledger.openAggregateChallenge{value: MIN_STAKE - 1}(runId, 1, 0, _fullSet(2), signers, shards, bytes32(0));
    }

    function test_openAggregateChallenge_revertsWith_WindowClosed_afterTheWindow() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        (address[] memory signers, bytes32[] memory shards) = (_signersOf(c), _shardsOf(c));
        uint64 deadline = uint64(block.timestamp) + WINDOW;
        vm.warp(deadline + 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerWindowClosed.selector, runId, 1, deadline));
        vm.prank(verifier);
        ledger.openAggregateChallenge{value: MIN_STAKE}(runId, 1, 0, _fullSet(2), signers, shards, bytes32(0));
    }

    function test_openAggregateChallenge_revertsWith_InsufficientStake_whenTheChallengerIsNotStaked() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        (address[] memory signers, bytes32[] memory shards) = (_signersOf(c), _shardsOf(c));
        address stranger = makeAddr("stranger");
        vm.deal(stranger, 10 ether);
        vm.expectRevert(
            abi.encodeWithSelector(ITrainingLedger.LedgerInsufficientStake.selector, stranger, 0, MIN_STAKE)
        );
        vm.prank(stranger);
        ledger.openAggregateChallenge{value: MIN_STAKE}(runId, 1, 0, _fullSet(2), signers, shards, bytes32(0));
    }

    function test_openAggregateChallenge_revertsWith_UnknownRun() public {
        bytes32[] memory shards = new bytes32[](2);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownRun.selector, 3));
        vm.prank(verifier);
        ledger.openAggregateChallenge{value: MIN_STAKE}(3, 1, 0, _fullSet(2), nodes, shards, bytes32(0));
    }

    function test_openAggregateChallenge_revertsWith_StepFinalized_onAFinalStep() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        (address[] memory signers, bytes32[] memory shards) = (_signersOf(c), _shardsOf(c));
        vm.warp(block.timestamp + WINDOW + 1);
        ledger.finalize(runId, 1);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerStepFinalized.selector, runId, 1));
        vm.prank(verifier);
        ledger.openAggregateChallenge{value: MIN_STAKE}(runId, 1, 0, _fullSet(2), signers, shards, bytes32(0));
    }

    function testFuzz_resolveChallenge_upheldAggregate_slashesEachCoSignerOnce(uint8 stageSeed, uint8 times) public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        uint32 stage = uint32(bound(stageSeed, 0, 1));
        uint256 n = bound(times, 1, 3);
        uint256[] memory ids = new uint256[](n);
        for (uint256 i = 0; i < n; ++i) {
            ids[i] = _challengeAggregate(c, stage);
        }
        uint256 poolsBefore = registry.totalPools();
        for (uint256 i = 0; i < n; ++i) {
            ledger.resolveChallenge(ids[i], true, _verdicts(ids[i], true, 2));
        }
        // Two co-signers slashed once each: the run's pool got half of each stake, no more.
        assertEq(registry.totalPools() - poolsBefore, MIN_STAKE);
        assertEq(_stakeTotal(nodes[stage]) + _stakeTotal(nodes[2 + stage]), 0);
        assertEq(_stakeTotal(nodes[1 - stage]), MIN_STAKE);
        _assertAccounting();
    }

    function test_coSignersOf_isEmptyForAReplayChallenge_andRevertsForAnUnknownOne() public {
        uint256 runId = _createRun();
        StepCall memory c = _commitNext(runId);
        uint256 id = _challenge(c, 0, 0);
        assertEq(ledger.coSignersOf(id).length, 0);
        vm.expectRevert(abi.encodeWithSelector(ITrainingLedger.LedgerUnknownChallenge.selector, 7));
        ledger.coSignersOf(7);
    }
}
