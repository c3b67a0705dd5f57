// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Test} from "forge-std/Test.sol";

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {ITrainingLedger} from "../src/interfaces/ITrainingLedger.sol";
import {LedgerHandler} from "./handlers/LedgerHandler.sol";

/// Invariant tests of the registry and ledger together, driven through a whole run's life:
/// commits of full and partial steps (one replica of two), equivocation reports, challenges and verdicts, rollbacks, finality, unbonding,
/// withdrawals and claims, in random order.
contract LedgerInvariantTest is Test {
    LedgerHandler internal handler;
    NodeRegistry internal registry;
    TrainingLedger internal ledger;
    uint256 internal runId;

    function setUp() public {
        handler = new LedgerHandler();
        registry = handler.registry();
        ledger = handler.ledger();
        runId = handler.runId();
        targetContract(address(handler));
    }

    /// The eleven checks below, after every call of every sequence, run as one invariant
    /// function: forge runs a campaign of 256 runs x depth 20 per invariant function, so
    /// each check sees as many sequences and calls as it would alone, for an eleventh of the
    /// time (MembershipInvariants.t.sol does the same). A failure names the check's assertion.
    function invariant_ledger() public view {
        check_registryBalanceEqualsStakesPlusOpenBondsPlusCredits();
        check_poolEqualsFundedPlusSlashIncomeMinusRewards();
        check_rewardsOnlyForFinalSteps_andOncePerSlot();
        check_noNodeIsSlashedTwiceForOneOffence();
        check_onlyEligibleNodesAttest();
        check_replicasNeverShareANode();
        check_badReplicaSetsAreRefused();
        check_headIsANonRejectedStepOrGenesis();
        check_finalizedStepsNeverChange();
        check_committedShardDigestsNeverChange();
        check_openChallengesPerNodeMatchTheLedger();
    }

    // The registry's balance equals the sum of stakes plus open bonds (plus the credits
    // rewarded, refunded or slashed but not yet claimed), by the registry's own totals and
    // by the handler's count of every wei in and out.
    function check_registryBalanceEqualsStakesPlusOpenBondsPlusCredits() internal view {
        uint256 stakes;
        address[] memory nodes = handler.nodes();
        for (uint256 i = 0; i < nodes.length; ++i) {
            (uint256 unbonding,) = registry.unbondingOf(nodes[i]);
            stakes += registry.stakeOf(nodes[i]) + unbonding;
        }
        stakes += registry.stakeOf(handler.verifier());
        assertEq(stakes, registry.totalStaked());
        uint256 credits;
        address[] memory payees = handler.payees();
        for (uint256 i = 0; i < payees.length; ++i) {
            credits += registry.creditOf(payees[i]);
        }
        assertEq(credits, registry.totalCredits());
        assertEq(registry.totalBonds(), handler.ghost_bonds());
        assertEq(address(registry).balance, stakes + registry.totalBonds() + credits + registry.totalPools());
        assertEq(address(registry).balance, handler.ghost_in() - handler.ghost_out());
    }

    // The run's pool is all the registry holds for pools: what was funded and slashed into
    // it, less the rewards paid; the ledger itself never holds ETH.
    function check_poolEqualsFundedPlusSlashIncomeMinusRewards() internal view {
        (uint256 pool,) = registry.poolOf(runId);
        assertEq(pool, registry.totalPools());
        assertEq(address(ledger).balance, 0);
        assertEq(registry.fundedBy(runId, address(handler)), pool + handler.ghost_rewardsPaid());
    }

    // No step is paid twice, no slot gets more than one share, and no step is paid before
    // its challenge window closed (finalizeSteps before it reverts).
    function check_rewardsOnlyForFinalSteps_andOncePerSlot() internal view {
        assertEq(handler.ghost_doublePaid(), 0);
        assertEq(handler.ghost_paidEarly(), 0);
    }

    // No node is slashed twice for one offence: a repeated equivocation proof (contribution or
    // result) reverts, and a second upheld challenge of the same slot or stage and record
    // takes nothing from a node already slashed for it.
    function check_noNodeIsSlashedTwiceForOneOffence() internal view {
        assertEq(handler.ghost_doubleSlashes(), 0);
    }

    // Every accepted step was attested only by members with at least the minimum active
    // stake at commit time (the eligibility cache never lets a slashed or unbonding node in).
    function check_onlyEligibleNodesAttest() internal view {
        assertEq(handler.ghost_ineligibleAccepted(), 0);
    }

    // No step is accepted whose replicas share a node: the replicas are independent witnesses.
    function check_replicasNeverShareANode() internal view {
        assertEq(handler.ghost_dependentAccepted(), 0);
    }

    // No step is accepted whose replica set the attestations do not match or the run does
    // not allow (no replica, a replica the run lacks, a present replica missing a stage, an
    // attestation outside the set or signed over another set), and each is refused by name.
    function check_badReplicaSetsAreRefused() internal view {
        assertEq(handler.ghost_badSetAccepted(), 0);
    }

    // The head is always a committed, non-rejected step, or the genesis.
    function check_headIsANonRejectedStepOrGenesis() internal view {
        (bytes32 head, uint64 headStep) = ledger.runHead(runId);
        ITrainingLedger.StepInfo memory info = ledger.stepInfo(runId, headStep);
        assertFalse(info.rejected);
        assertEq(info.checkpoint, head);
        assertTrue(head != bytes32(0));
        if (headStep == 0) assertEq(head, handler.GENESIS());
        assertLe(ledger.finalizedStep(runId), headStep);
    }

    // Finalized steps never change: each keeps the checkpoint it had when it was made final,
    // is never rejected, and stays on the chain below the head.
    function check_finalizedStepsNeverChange() internal view {
        uint256 count = handler.finalStepCount();
        uint64 finalized = ledger.finalizedStep(runId);
        assertEq(finalized, count == 0 ? 0 : handler.ghost_finalSteps(count - 1));
        for (uint256 i = 0; i < count; ++i) {
            uint64 step = handler.ghost_finalSteps(i);
            ITrainingLedger.StepInfo memory info = ledger.stepInfo(runId, step);
            assertEq(info.checkpoint, handler.ghost_finalCheckpoint(step));
            assertFalse(info.rejected);
            assertEq(ledger.stepCheckpoint(runId, step), info.checkpoint);
        }
    }

    // A committed step's co-signed shard digests (and its signers) never change: every step
    // on the chain keeps the witness hash of what was committed, whatever challenges,
    // verdicts, expiries and finality did since (only a new commit after a rollback replaces it).
    function check_committedShardDigestsNeverChange() internal view {
        (, uint64 headStep) = ledger.runHead(runId);
        for (uint64 step = 1; step <= headStep; ++step) {
            assertEq(ledger.stepInfo(runId, step).witnessHash, handler.ghost_witness(step));
        }
    }

    // A node's withdrawal is held by exactly the challenges open against it.
    function check_openChallengesPerNodeMatchTheLedger() internal view {
        address[] memory nodes = handler.nodes();
        for (uint256 i = 0; i < nodes.length; ++i) {
            assertEq(registry.openChallengesOf(nodes[i]), handler.ghost_openChallengesAgainst(nodes[i]));
        }
    }
}
