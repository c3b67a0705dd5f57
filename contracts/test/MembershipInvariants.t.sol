// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Test} from "forge-std/Test.sol";

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {MembershipHandler} from "./handlers/MembershipHandler.sol";

/// Invariant tests of open membership and reward pools (issue 35): an open, an approved and
/// a closed run on one registry, driven by {MembershipHandler} through joins and leaves,
/// commits, funding, finality with rewards, challenges, slashes, run ends, pool
/// withdrawals, unbonding and claims in random order.
abstract contract MembershipChecks is Test {
    MembershipHandler internal handler;
    NodeRegistry internal registry;
    TrainingLedger internal ledger;

    function _deploy() internal {
        handler = new MembershipHandler();
        registry = handler.registry();
        ledger = handler.ledger();
    }

    // The registry holds locked exactly the minimum stake of every run a node joined and has
    // not left (founders lock nothing), and the ledger's membership is the handler's.
    function _checkLockedStake() internal view {
        address[] memory nodes = handler.nodes();
        for (uint256 i = 0; i < nodes.length; ++i) {
            assertEq(registry.lockedOf(nodes[i]), handler.expectedLocked(nodes[i]), "locked stake");
            for (uint256 r = 0; r < handler.RUNS(); ++r) {
                assertEq(ledger.isMember(handler.runId(r), nodes[i]), handler.isMember(r, nodes[i]), "membership");
            }
        }
    }

    // Per run: what is in the pool, plus the rewards credited out of it, plus the leftovers
    // withdrawn, equals everything that went in (funding at creation and later, and the
    // slashed stake that is not the reporter's). Each funder's part is what it put in and
    // has not withdrawn, and the parts add up to the pool's funding; the pools add up to
    // the registry's total.
    function _checkPools() internal view {
        address[] memory funders = handler.funders();
        uint256 pools;
        for (uint256 r = 0; r < handler.RUNS(); ++r) {
            uint256 id = handler.runId(r);
            (uint256 pool, uint256 funded) = registry.poolOf(id);
            assertEq(
                pool + handler.ghost_rewardsPaid(r) + handler.ghost_withdrawn(r),
                handler.ghost_funded(r) + handler.ghost_slashIncome(r),
                "pool conservation"
            );
            uint256 parts;
            for (uint256 f = 0; f < funders.length; ++f) {
                uint256 part = registry.fundedBy(id, funders[f]);
                assertEq(part, handler.ghost_fundedBy(r, funders[f]), "funder's part");
                parts += part;
            }
            assertEq(parts, funded, "parts add up to the funding");
            assertLe(pool, funded);
            pools += pool;
        }
        assertEq(pools, registry.totalPools(), "pools add up");
    }

    // Solvency: the registry holds exactly stakes + bonds + unclaimed credits + pools, each
    // total matches its parts, the balance is every wei in less every wei out, and the
    // ledger holds no ETH.
    function _checkSolvency() internal view {
        uint256 stakes = registry.stakeOf(handler.verifier());
        address[] memory nodes = handler.nodes();
        for (uint256 i = 0; i < nodes.length; ++i) {
            (uint256 unbonding,) = registry.unbondingOf(nodes[i]);
            stakes += registry.stakeOf(nodes[i]) + unbonding;
        }
        assertEq(stakes, registry.totalStaked(), "stakes");
        uint256 credits;
        address[] memory payees = handler.payees();
        for (uint256 i = 0; i < payees.length; ++i) {
            credits += registry.creditOf(payees[i]);
        }
        assertEq(credits, registry.totalCredits(), "credits");
        assertEq(registry.totalBonds(), handler.ghost_bonds(), "bonds");
        assertEq(
            address(registry).balance, stakes + registry.totalBonds() + credits + registry.totalPools(), "solvency"
        );
        assertEq(address(registry).balance, handler.ghost_in() - handler.ghost_out(), "wei in less wei out");
        assertEq(address(ledger).balance, 0);
    }

    // No step is accepted with a signer that was not a member of its run when it was
    // committed (never joined, or left: the eligibility cache never waves one through).
    function _checkMembersOnly() internal view {
        assertEq(handler.ghost_nonMemberAccepted(), 0);
    }

    // Rewards: no step is paid twice or before its window closed; a record rejected by a
    // rollback or named by an upheld challenge pays nothing; every credit is exactly the
    // expected share (nothing to a node slashed at or after the step's commit), every
    // pool withdrawal exactly the funder's pro-rata part; and every refusal of a join, a
    // leave, an unbond, an equivocation report or a withdrawal names the expected error.
    function _checkRewards() internal view {
        assertEq(handler.ghost_doublePaid(), 0, "paid twice");
        assertEq(handler.ghost_badRecordPaid(), 0, "rejected or upheld record paid");
        assertEq(handler.ghost_paidEarly(), 0, "paid before final");
        assertEq(handler.ghost_payMismatch(), 0, "credit differs from the expected");
        assertEq(handler.ghost_wrongRefusal(), 0, "refusal differs from the expected");
    }
}

/// The five checks above run as one invariant: forge runs a campaign per invariant
/// function, and one campaign at the profile's runs and depth (256 x 20 by default) checks
/// all of them after every call at a fifth of the time, keeping the forge stage short.
contract MembershipInvariantTest is MembershipChecks {
    function setUp() public {
        _deploy();
        targetContract(address(handler));
    }

    function invariant_membershipLocksPoolsSolvencyAndRewards() public view {
        _checkLockedStake();
        _checkPools();
        _checkSolvency();
        _checkMembersOnly();
        _checkRewards();
    }
}

/// A fixed sequence through {MembershipHandler} that reaches every path the invariants rely
/// on (so they cannot pass vacuously), then checks them.
contract MembershipHandlerCoverageTest is MembershipChecks {
    function test_aScriptedSequence_reachesEveryPath_andKeepsTheInvariants() public {
        _deploy();
        MembershipHandler h = handler;
        // Node 3 joins the open run; node 4 the approved run (an expired, a foreign and a
        // missing admission first); node 5 is refused the closed run.
        h.join(0, 3, 0, 0);
        h.join(1, 4, 1, 5);
        h.join(1, 4, 2, 5);
        h.join(1, 4, 4, 5);
        h.join(1, 4, 0, 5);
        h.join(2, 5, 0, 0);
        assertEq(h.ghost_joins(), 2);
        assertEq(h.ghost_joinsRefused(), 4);
        assertEq(h.expectedLocked(h.nodes()[3]), 1 ether);
        // Steps on both runs, one of them paid after its window.
        for (uint256 s = 0; s < 4; ++s) {
            h.commit(0, s);
            h.commit(1, s);
        }
        assertEq(h.ghost_commits(), 8);
        h.finalize(0, 1, 2);
        h.finalize(1, 1, 3);
        assertGt(h.ghost_stepsPaid(), 2);
        // Both founders of the open run leave; steps with a non-member's signature are refused.
        h.leave(0, 0);
        h.leave(0, 1);
        h.commitNonMember(0, 2);
        h.commitNonMember(1, 2);
        assertEq(h.ghost_nonMemberRefused(), 2);
        // The joined node commits alone (one replica); an upheld challenge of that step
        // slashes it and rolls it back; an equivocation slashes a founder of the approved run.
        h.commit(0, 2);
        h.challenge(0, 5, 0);
        h.resolve(0, true);
        h.equivocate(1, 2, 1, 1, 2);
        assertEq(h.ghost_upheld(), 1);
        assertEq(h.ghost_slashes(), 2);
        h.finalizeEarlyOrAgain(0);
        // Both reward runs end; the steps due are paid (nothing to the slashed nodes) and the
        // funders withdraw what is left.
        h.fund(0, 2, 0.5 ether);
        h.endRun(0, 0);
        h.endRun(1, 0);
        h.withdrawPool(0, 0);
        h.withdrawPool(0, 2);
        h.withdrawPool(1, 1);
        assertEq(h.ghost_poolWithdrawals(), 3);
        for (uint256 p = 0; p < h.payees().length; ++p) {
            h.claim(p);
        }

        _checkLockedStake();
        _checkPools();
        _checkSolvency();
        _checkMembersOnly();
        _checkRewards();
    }
}
