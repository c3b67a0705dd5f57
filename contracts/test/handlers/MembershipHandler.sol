// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {CommonBase} from "forge-std/Base.sol";
import {StdUtils} from "forge-std/StdUtils.sol";

import {NodeRegistry} from "../../src/NodeRegistry.sol";
import {TrainingLedger} from "../../src/TrainingLedger.sol";
import {INodeRegistry} from "../../src/interfaces/INodeRegistry.sol";
import {ITrainingLedger} from "../../src/interfaces/ITrainingLedger.sol";

/// @notice Drives one registry and ledger through open membership and rewards: three runs
/// side by side (run 0 `Open`, run 1 `Approved` by its creator's EIP-712 admissions, run 2
/// `Closed`) over six nodes, with joins (valid, expired, foreign and missing admissions,
/// too little free stake), leaves and re-joins, commits by the current members (full and
/// partial replica sets), commits that slip a non-member in, funding by anyone, finality
/// with rewards (one step or several per call), slot challenges upheld or rejected,
/// equivocation slashes, run ends and pool withdrawals, unbonding, withdrawals and claims.
///
/// Every call is expected to succeed or to fail with one named error, which the handler
/// predicts from its own ghost state (not from the contracts' answers) and counts when the
/// contracts disagree. Ghost totals follow every wei in and out, per run and overall.
contract MembershipHandler is CommonBase, StdUtils {
    uint256 public constant NODES = 6;
    uint256 public constant RUNS = 3;
    uint64 public constant WINDOW = 50;
    uint256 public constant REPORTER_BPS = 5_000;
    bytes32 public constant GENESIS = keccak256("genesis");

    /// @dev Membership as the ledger keeps it: none, named at creation, joined, left.
    uint8 public constant NONE = 0;
    uint8 public constant FOUNDER = 1;
    uint8 public constant JOINED = 2;
    uint8 public constant LEFT = 3;

    NodeRegistry public immutable registry;
    TrainingLedger public immutable ledger;
    address public immutable verifier;
    address public immutable creatorB;

    uint256 internal constant _CREATOR_B_KEY = 0xC100;
    uint256 internal constant _STRANGER_KEY = 0xBAD;

    /// @dev Per run index: the ledger's id, minimum stake, reward per step and creator.
    uint256[RUNS] internal _runIds;
    uint256[RUNS] internal _minStakes;
    uint128[RUNS] internal _rewards;
    address[RUNS] internal _creators;
    bool[RUNS] internal _ended;
    uint64[RUNS] internal _endedAt;

    uint256[] internal _nodeKeys;
    address[] internal _nodes;
    mapping(address node => uint256) internal _indexOf;
    uint256[] internal _arbiterKeys;
    address[] internal _funders;
    address[] internal _payees;
    uint256[] internal _openChallenges;
    uint256 internal _nonce;

    /// @dev What the handler committed as each step's current record of a run.
    struct Record {
        address[] signers;
        bytes32[] shards;
        uint256 set;
        uint32 epoch;
    }

    mapping(uint256 r => mapping(uint64 step => Record)) internal _records;

    // ---------------------------------------------------------------- ghosts

    uint256 public ghost_in;
    uint256 public ghost_out;
    uint256 public ghost_bonds;
    mapping(uint256 r => mapping(address node => uint8)) public ghost_status;
    mapping(uint256 r => uint256) public ghost_funded;
    mapping(uint256 r => uint256) public ghost_slashIncome;
    mapping(uint256 r => uint256) public ghost_rewardsPaid;
    mapping(uint256 r => uint256) public ghost_withdrawn;
    mapping(uint256 r => mapping(address funder => uint256)) public ghost_fundedBy;
    mapping(uint256 r => mapping(uint64 step => uint256)) public ghost_paidTimes;
    /// @dev Records (run, step, epoch) rejected by a rollback or named by an upheld challenge.
    mapping(uint256 r => mapping(uint64 step => mapping(uint32 epoch => bool))) public ghost_badRecord;
    mapping(bytes32 offence => bool) public ghost_offenceSlashed;
    mapping(address node => uint64) public ghost_slashedAt;
    mapping(address node => uint256) public ghost_openChallengesAgainst;

    /// @dev Violations: each must stay zero.
    uint256 public ghost_nonMemberAccepted;
    uint256 public ghost_doublePaid;
    uint256 public ghost_badRecordPaid;
    uint256 public ghost_paidEarly;
    uint256 public ghost_payMismatch;
    uint256 public ghost_wrongRefusal;

    /// @dev Coverage: how often each path ran.
    uint256 public ghost_joins;
    uint256 public ghost_joinsRefused;
    uint256 public ghost_leaves;
    uint256 public ghost_commits;
    uint256 public ghost_nonMemberRefused;
    uint256 public ghost_stepsPaid;
    uint256 public ghost_upheld;
    uint256 public ghost_slashes;
    uint256 public ghost_poolWithdrawals;

    constructor() {
        registry = new NodeRegistry(vm.addr(0xdead), REPORTER_BPS, 1 days);
        ledger = new TrainingLedger(registry);
        registry.bindLedger(address(ledger));

        for (uint256 i = 0; i < NODES; ++i) {
            _nodeKeys.push(0xA100 + i);
            _nodes.push(vm.addr(0xA100 + i));
            _indexOf[_nodes[i]] = i;
            _payees.push(_nodes[i]);
            _payees.push(_operator(i));
            vm.prank(_nodes[i]);
            registry.register(_operator(i));
            _stakeFor(i, 1.5 ether);
        }
        address[] memory arbiters = new address[](3);
        for (uint256 i = 0; i < 3; ++i) {
            _arbiterKeys.push(0xB000 + i);
            arbiters[i] = vm.addr(0xB000 + i);
        }
        verifier = vm.addr(0xC000);
        vm.prank(verifier);
        registry.register(verifier);
        vm.deal(verifier, 1_000 ether);
        vm.prank(verifier);
        registry.stake{value: 10 ether}(verifier);
        ghost_in += 10 ether;

        creatorB = vm.addr(_CREATOR_B_KEY);
        _funders.push(address(this));
        _funders.push(creatorB);
        _funders.push(vm.addr(0xF000));
        _funders.push(vm.addr(0xF001));
        for (uint256 i = 0; i < _funders.length; ++i) {
            _payees.push(_funders[i]);
        }
        _payees.push(verifier);
        _payees.push(vm.addr(0xdead));

        _createRuns(arbiters);
    }

    /// @dev Run 0: open, founders nodes 0 and 1, minimum 1 ether, 0.3 ether a step, 2 ether
    /// in the pool. Run 1: approved by `creatorB`, founder node 2, minimum 0.5 ether, 0.2
    /// ether a step, 1 ether in the pool. Run 2: closed, founders nodes 0 and 3, no rewards.
    function _createRuns(address[] memory arbiters) internal {
        address[] memory founders = new address[](2);
        (founders[0], founders[1]) = (_nodes[0], _nodes[1]);
        vm.deal(address(this), 2 ether);
        _runIds[0] = ledger.createRun{value: 2 ether}(
            _spec(founders, 1 ether, arbiters, ITrainingLedger.Admission.Open, 0.3 ether)
        );
        _afterCreate(0, address(this), 1 ether, 0.3 ether, 2 ether, founders);

        founders = new address[](1);
        founders[0] = _nodes[2];
        vm.deal(creatorB, 1 ether);
        vm.prank(creatorB);
        _runIds[1] = ledger.createRun{value: 1 ether}(
            _spec(founders, 0.5 ether, arbiters, ITrainingLedger.Admission.Approved, 0.2 ether)
        );
        _afterCreate(1, creatorB, 0.5 ether, 0.2 ether, 1 ether, founders);

        founders = new address[](2);
        (founders[0], founders[1]) = (_nodes[0], _nodes[3]);
        _runIds[2] = ledger.createRun(_spec(founders, 1 ether, arbiters, ITrainingLedger.Admission.Closed, 0));
        _afterCreate(2, address(this), 1 ether, 0, 0, founders);
    }

    function _spec(
        address[] memory founders,
        uint256 minimum,
        address[] memory arbiters,
        ITrainingLedger.Admission admission,
        uint128 reward
    ) internal pure returns (ITrainingLedger.RunSpec memory) {
        return ITrainingLedger.RunSpec({
            configDigest: keccak256("config"),
            genesisDigest: GENESIS,
            nodes: founders,
            replicas: 2,
            stages: 2,
            minReplicas: 1,
            challengeWindow: WINDOW,
            minStake: minimum,
            arbiters: arbiters,
            quorum: 2,
            independence: uint8(ITrainingLedger.Independence.Keys),
            admission: uint8(admission),
            rewardPerStep: reward
        });
    }

    function _afterCreate(
        uint256 r,
        address creator,
        uint256 minimum,
        uint128 reward,
        uint256 funded,
        address[] memory founders
    ) internal {
        _creators[r] = creator;
        _minStakes[r] = minimum;
        _rewards[r] = reward;
        ghost_in += funded;
        ghost_funded[r] += funded;
        ghost_fundedBy[r][creator] += funded;
        for (uint256 i = 0; i < founders.length; ++i) {
            ghost_status[r][founders[i]] = FOUNDER;
        }
    }

    /// @dev Claims of the reporter's share and of withdrawn pool parts land here.
    receive() external payable {}

    // ---------------------------------------------------------------- views for invariants

    function nodes() external view returns (address[] memory) {
        return _nodes;
    }

    function payees() external view returns (address[] memory) {
        return _payees;
    }

    function funders() external view returns (address[] memory) {
        return _funders;
    }

    function runId(uint256 r) external view returns (uint256) {
        return _runIds[r];
    }

    function minStake(uint256 r) external view returns (uint256) {
        return _minStakes[r];
    }

    function isMember(uint256 r, address node) public view returns (bool) {
        uint8 status = ghost_status[r][node];
        return status == FOUNDER || status == JOINED;
    }

    /// @notice What the registry should hold locked of `node`: the minimum stake of every
    /// run it joined and has not left (founders lock nothing).
    function expectedLocked(address node) public view returns (uint256 locked) {
        for (uint256 r = 0; r < RUNS; ++r) {
            if (ghost_status[r][node] == JOINED) locked += _minStakes[r];
        }
    }

    // ---------------------------------------------------------------- membership

    /// @notice A node asks to join a run; `mode` picks, for the approved run, a valid
    /// admission, an expired one, one signed by a stranger, one for another node, or none.
    function join(uint256 runSeed, uint256 nodeSeed, uint256 mode, uint256 expirySeed) external {
        uint256 r = bound(runSeed, 0, RUNS - 1);
        uint256 i = bound(nodeSeed, 0, NODES - 1);
        address node = _nodes[i];
        mode %= 5;
        uint64 expiry = uint64(block.timestamp + bound(expirySeed, 0, 1_000));
        if (mode == 1) expiry = uint64(bound(expirySeed, 0, block.timestamp - 1));
        bytes memory admission;
        if (mode == 0 || mode == 1) admission = _sign(_CREATOR_B_KEY, ledger.admissionDigest(_runIds[r], node, expiry));
        if (mode == 2) admission = _sign(_STRANGER_KEY, ledger.admissionDigest(_runIds[r], node, expiry));
        if (mode == 3) {
            address other = _nodes[(i + 1) % NODES];
            admission = _sign(_CREATOR_B_KEY, ledger.admissionDigest(_runIds[r], other, expiry));
        }

        bytes4 want = _joinRefusal(r, node, mode);
        vm.prank(node);
        try ledger.joinRun(_runIds[r], expiry, admission) {
            if (want != bytes4(0)) ghost_wrongRefusal += 1;
            ghost_status[r][node] = JOINED;
            ghost_joins += 1;
        } catch (bytes memory reason) {
            if (want == bytes4(0) || bytes4(reason) != want) ghost_wrongRefusal += 1;
            ghost_joinsRefused += 1;
        }
    }

    /// @dev The error joinRun must refuse `node` with (in the ledger's order of checks), or
    /// zero if it must admit it.
    function _joinRefusal(uint256 r, address node, uint256 mode) internal view returns (bytes4) {
        if (_ended[r]) return ITrainingLedger.LedgerRunEnded.selector;
        if (r == 2) return ITrainingLedger.LedgerRunClosed.selector;
        if (isMember(r, node)) return ITrainingLedger.LedgerAlreadyMember.selector;
        if (r == 1) {
            if (mode == 4) return ITrainingLedger.LedgerAdmissionRequired.selector;
            if (mode == 1) return ITrainingLedger.LedgerAdmissionExpired.selector;
            if (mode == 2 || mode == 3) return ITrainingLedger.LedgerAdmissionNotByCreator.selector;
        }
        uint256 active = registry.stakeOf(node);
        uint256 locked = expectedLocked(node);
        uint256 free = active > locked ? active - locked : 0;
        if (free < _minStakes[r]) return INodeRegistry.RegistryInsufficientFreeStake.selector;
        return bytes4(0);
    }

    /// @notice A node leaves a run (refused by name if it is not a member).
    function leave(uint256 runSeed, uint256 nodeSeed) external {
        uint256 r = bound(runSeed, 0, RUNS - 1);
        address node = _nodes[bound(nodeSeed, 0, NODES - 1)];
        bool member = isMember(r, node);
        vm.prank(node);
        try ledger.leaveRun(_runIds[r]) {
            if (!member) ghost_wrongRefusal += 1;
            ghost_status[r][node] = LEFT;
            ghost_leaves += 1;
        } catch (bytes memory reason) {
            if (member || bytes4(reason) != ITrainingLedger.LedgerNotMember.selector) ghost_wrongRefusal += 1;
        }
    }

    // ---------------------------------------------------------------- commits

    /// @notice Commits the next step of run 0 or 1 over both replicas or one, every slot
    /// signed by a current member (topping up a slashed stake; never an unbonding node).
    function commit(uint256 runSeed, uint256 seed) external {
        uint256 r = runSeed % 2;
        if (_ended[r]) return;
        uint256 set = seed % 4 < 2 ? 3 : seed % 4 - 1;
        (address[] memory signers, uint256[] memory keys) = _pickMembers(r, seed, set);
        if (signers.length == 0) return;
        _commit(r, set, signers, keys);
        for (uint256 k = 0; k < signers.length; ++k) {
            if (!isMember(r, signers[k])) ghost_nonMemberAccepted += 1;
        }
        ghost_commits += 1;
    }

    /// @notice Tries to commit the next step with a signer that is not a member (never was,
    /// or left): replaying the last committed signer list when one of them left since (the
    /// ledger's eligibility cache must not wave it through), else one slot handed to a
    /// non-member. The ledger must refuse with {LedgerNotMember}.
    function commitNonMember(uint256 runSeed, uint256 seed) external {
        uint256 r = runSeed % 2;
        if (_ended[r]) return;
        (, uint64 headStep) = ledger.runHead(_runIds[r]);
        Record storage last = _records[r][headStep];
        address[] memory signers;
        uint256 set;
        if (headStep != 0 && _anyNonMember(r, last.signers)) {
            (signers, set) = (last.signers, last.set);
        } else {
            set = seed % 4 < 2 ? 3 : seed % 4 - 1;
            (signers,) = _pickMembers(r, seed, set);
            address outsider = _pickNonMember(r, seed);
            if (signers.length == 0 || outsider == address(0)) return;
            signers[seed % signers.length] = outsider;
        }
        uint256[] memory keys = new uint256[](signers.length);
        for (uint256 k = 0; k < signers.length; ++k) {
            keys[k] = _nodeKeys[_indexOf[signers[k]]];
            _topUp(r, signers[k]);
        }
        (uint64 step, bytes32 head, ITrainingLedger.Attestation[] memory atts, bytes32 root) =
            _attestations(r, keys, set, bytes32(_nonce));
        try ledger.commitStep(_runIds[r], step, head, keccak256(abi.encode("outsider", seed)), root, 0, set, atts) {
            ghost_nonMemberAccepted += 1;
        } catch (bytes memory reason) {
            if (bytes4(reason) != ITrainingLedger.LedgerNotMember.selector) ghost_nonMemberAccepted += 1;
            ghost_nonMemberRefused += 1;
        }
    }

    function _anyNonMember(uint256 r, address[] storage signers) internal view returns (bool) {
        for (uint256 k = 0; k < signers.length; ++k) {
            if (!isMember(r, signers[k])) return true;
        }
        return false;
    }

    /// @dev A node that is not a member of run `r` (never joined or left); zero if none.
    function _pickNonMember(uint256 r, uint256 seed) internal view returns (address) {
        for (uint256 k = 0; k < NODES; ++k) {
            address node = _nodes[(k + seed / 7) % NODES];
            if (!isMember(r, node)) return node;
        }
        return address(0);
    }

    /// @dev A current, not unbonding member of run `r` per slot of `set` (stake topped up to
    /// the run's minimum), the two replicas' signers distinct; empty if there are not enough.
    /// Stages of one replica go to different members where that leaves enough for the other
    /// replica, else to one.
    function _pickMembers(uint256 r, uint256 seed, uint256 set)
        internal
        returns (address[] memory signers, uint256[] memory keys)
    {
        (signers, keys) = _tryPick(r, seed, set, false);
        if (signers.length == 0) (signers, keys) = _tryPick(r, seed, set, true);
    }

    function _tryPick(uint256 r, uint256 seed, uint256 set, bool oneNodePerReplica)
        internal
        returns (address[] memory signers, uint256[] memory keys)
    {
        uint256 slots = set == 3 ? 4 : 2;
        signers = new address[](slots);
        keys = new uint256[](slots);
        for (uint256 slot = 0; slot < slots; ++slot) {
            if (oneNodePerReplica && slot % 2 == 1) {
                (signers[slot], keys[slot]) = (signers[slot - 1], keys[slot - 1]);
                continue;
            }
            uint256 start = uint256(keccak256(abi.encode(seed, slot))) % NODES;
            bool found = false;
            for (uint256 k = 0; k < NODES && !found; ++k) {
                uint256 i = (start + k) % NODES;
                address node = _nodes[i];
                if (!isMember(r, node) || _unbonding(node)) continue;
                // Replicas are independent witnesses: no node signs for both.
                if (slot >= 2 && (node == signers[0] || node == signers[1])) continue;
                _topUp(r, node);
                (signers[slot], keys[slot]) = (node, _nodeKeys[i]);
                found = true;
            }
            if (!found) return (new address[](0), new uint256[](0));
        }
    }

    /// @dev Commits the next step of run `r` over `set`, slot k signed by `keys[k]`, and
    /// records what was committed.
    function _commit(uint256 r, uint256 set, address[] memory signers, uint256[] memory keys) internal {
        (uint64 step, bytes32 head, ITrainingLedger.Attestation[] memory atts, bytes32 root) =
            _attestations(r, keys, set, bytes32(++_nonce));
        ledger.commitStep(_runIds[r], step, head, keccak256(abi.encode("checkpoint", _nonce)), root, 0, set, atts);
        Record storage rec = _records[r][step];
        rec.signers = signers;
        rec.shards = new bytes32[](2);
        (rec.shards[0], rec.shards[1]) = (atts[0].newShard, atts[1].newShard);
        rec.set = set;
        rec.epoch = ledger.stepInfo(_runIds[r], step).epoch;
    }

    /// @dev The attestations of the step after run `r`'s head over `set` ({0, 1}, {0} or
    /// {1}), slot k signed by `keys[k]`, and their contributions root.
    function _attestations(uint256 r, uint256[] memory keys, uint256 set, bytes32 salt)
        internal
        view
        returns (uint64 step, bytes32 head, ITrainingLedger.Attestation[] memory atts, bytes32 root)
    {
        uint64 headStep;
        (head, headStep) = ledger.runHead(_runIds[r]);
        step = headStep + 1;
        atts = new ITrainingLedger.Attestation[](keys.length);
        bytes memory packed;
        for (uint256 slot = 0; slot < atts.length; ++slot) {
            uint32 replica = set == 2 ? 1 : uint32(slot / 2);
            atts[slot] = _attest(r, keys[slot], step, head, replica, uint32(slot % 2), set, salt);
            packed = bytes.concat(packed, atts[slot].contribution);
        }
        root = keccak256(packed);
    }

    // ---------------------------------------------------------------- pools and finality

    /// @notice Anyone adds to a run's pool.
    function fund(uint256 runSeed, uint256 funderSeed, uint256 amount) external {
        uint256 r = bound(runSeed, 0, RUNS - 1);
        address funder = _funders[bound(funderSeed, 0, _funders.length - 1)];
        amount = bound(amount, 1, 1 ether);
        vm.deal(funder, funder.balance + amount);
        vm.prank(funder);
        ledger.fundRun{value: amount}(_runIds[r]);
        ghost_in += amount;
        ghost_funded[r] += amount;
        ghost_fundedBy[r][funder] += amount;
    }

    /// @notice Finalizes (and pays) the next one to three steps of run 0 or 1 whose windows
    /// passed and which no challenge holds, in one finalizeSteps call; waits for the windows
    /// when `wait` is odd.
    function finalize(uint256 runSeed, uint256 wait, uint256 countSeed) external {
        uint256 r = runSeed % 2;
        uint256 id = _runIds[r];
        (, uint64 headStep) = ledger.runHead(id);
        uint64 first = ledger.finalizedStep(id) + 1;
        uint64 last = first - 1;
        uint64 most = first + uint64(bound(countSeed, 1, 3)) - 1;
        for (uint64 step = first; step <= headStep && step <= most; ++step) {
            ITrainingLedger.StepInfo memory info = ledger.stepInfo(id, step);
            if (info.openChallenges != 0) break;
            uint256 deadline = info.committedAt + WINDOW;
            if (block.timestamp <= deadline) {
                if (wait % 2 == 0) break;
                vm.warp(deadline + 1);
            }
            last = step;
        }
        if (last >= first) _finalizeAndPay(r, first, last);
    }

    /// @notice Tries to finalize a reward run's next step before its window closes, through
    /// finalizeSteps or the witness-less finalize, and to replay the last final step's
    /// witness: the ledger must refuse each.
    function finalizeEarlyOrAgain(uint256 runSeed) external {
        uint256 r = runSeed % 2;
        uint256 id = _runIds[r];
        (, uint64 headStep) = ledger.runHead(id);
        uint64 finalized = ledger.finalizedStep(id);
        if (finalized != 0) {
            try ledger.finalizeSteps(id, _witnessOf(r, finalized)) {
                ghost_doublePaid += 1;
            } catch {}
        }
        uint64 step = finalized + 1;
        if (step > headStep) return;
        try ledger.finalize(id, step) {
            ghost_paidEarly += 1;
        } catch (bytes memory reason) {
            if (bytes4(reason) != ITrainingLedger.LedgerRewardNeedsWitnesses.selector) ghost_paidEarly += 1;
        }
        if (block.timestamp > ledger.stepInfo(id, step).committedAt + WINDOW) return;
        try ledger.finalizeSteps(id, _witnessOf(r, step)) {
            ghost_paidEarly += 1;
        } catch {}
    }

    /// @dev Finalizes steps `first` to `last` of run `r` in one call and checks every credit
    /// against what the handler expects: per step, min(reward, pool) split over its slots,
    /// nothing to a node slashed at or after the step's commit.
    function _finalizeAndPay(uint256 r, uint64 first, uint64 last) internal {
        uint256 id = _runIds[r];
        uint256 count = last - first + 1;
        ITrainingLedger.StepWitness[] memory w = new ITrainingLedger.StepWitness[](count);
        uint256[] memory expected = new uint256[](NODES);
        uint256[] memory before = new uint256[](NODES);
        for (uint256 i = 0; i < NODES; ++i) {
            before[i] = registry.creditOf(_nodes[i]);
        }
        (uint256 pool,) = registry.poolOf(id);
        uint256 total;
        for (uint64 step = first; step <= last; ++step) {
            w[step - first] = _witnessOf(r, step)[0];
            uint256 paid = _expectStepPay(r, step, pool, expected);
            pool -= paid;
            total += paid;
        }
        uint256 creditsBefore = registry.totalCredits();
        ledger.finalizeSteps(id, w);
        if (registry.totalCredits() - creditsBefore != total) ghost_payMismatch += 1;
        for (uint256 i = 0; i < NODES; ++i) {
            if (registry.creditOf(_nodes[i]) - before[i] != expected[i]) ghost_payMismatch += 1;
        }
        ghost_rewardsPaid[r] += total;
    }

    /// @dev Adds what step `step` of run `r` must pay each node to `expected` (by node
    /// index), given the pool before it; returns the step's total. Flags a second payment
    /// of a step, a payment of a rejected or upheld record, and one before the window closed.
    function _expectStepPay(uint256 r, uint64 step, uint256 pool, uint256[] memory expected)
        internal
        returns (uint256 total)
    {
        ITrainingLedger.StepInfo memory info = ledger.stepInfo(_runIds[r], step);
        Record storage rec = _records[r][step];
        if (ghost_paidTimes[r][step] != 0) ghost_doublePaid += 1;
        ghost_paidTimes[r][step] += 1;
        if (ghost_badRecord[r][step][rec.epoch] || info.rejected) ghost_badRecordPaid += 1;
        if (block.timestamp <= info.committedAt + WINDOW) ghost_paidEarly += 1;
        if (info.epoch != rec.epoch) ghost_payMismatch += 1;
        ghost_stepsPaid += 1;
        uint256 reward = _rewards[r] < pool ? _rewards[r] : pool;
        uint256 share = reward / rec.signers.length;
        for (uint256 k = 0; k < rec.signers.length; ++k) {
            address node = rec.signers[k];
            uint64 slashedAt = ghost_slashedAt[node];
            if (slashedAt != 0 && slashedAt >= info.committedAt) continue;
            expected[_indexOf[node]] += share;
            total += share;
        }
    }

    /// @dev The witness of step `step`'s current record of run `r`, as finalizeSteps takes it.
    function _witnessOf(uint256 r, uint64 step) internal view returns (ITrainingLedger.StepWitness[] memory w) {
        Record storage rec = _records[r][step];
        w = new ITrainingLedger.StepWitness[](1);
        w[0] = ITrainingLedger.StepWitness({
            signers: rec.signers, shardsRoot: keccak256(abi.encodePacked(rec.shards)), replicaSet: rec.set
        });
    }

    /// @notice The creator ends a run (one call in three goes ahead).
    function endRun(uint256 runSeed, uint256 seed) external {
        uint256 r = bound(runSeed, 0, RUNS - 1);
        if (_ended[r] || seed % 3 != 0) return;
        vm.prank(_creators[r]);
        ledger.endRun(_runIds[r]);
        _ended[r] = true;
        _endedAt[r] = uint64(block.timestamp);
    }

    /// @notice A funder withdraws its part of what is left in a run's pool: before the end
    /// (refused), or after it, once the delay passed (waited for) and the steps due are
    /// final (finalized here unless a challenge holds one).
    function withdrawPool(uint256 runSeed, uint256 funderSeed) external {
        uint256 r = bound(runSeed, 0, RUNS - 1);
        address funder = _funders[bound(funderSeed, 0, _funders.length - 1)];
        uint256 id = _runIds[r];
        bytes4 want = bytes4(0);
        if (!_ended[r]) {
            want = ITrainingLedger.LedgerPoolLocked.selector;
        } else {
            uint256 until = uint256(_endedAt[r]) + ledger.resolutionPeriod();
            if (block.timestamp < until) vm.warp(until);
            _finalizeDue(r);
            (, uint64 headStep) = ledger.runHead(id);
            if (ledger.finalizedStep(id) != headStep) want = ITrainingLedger.LedgerStepsNotFinal.selector;
            else if (ghost_fundedBy[r][funder] == 0) want = INodeRegistry.RegistryNothingToWithdraw.selector;
        }
        (uint256 balance, uint256 funded) = registry.poolOf(id);
        uint256 part = ghost_fundedBy[r][funder];
        uint256 creditBefore = registry.creditOf(funder);
        vm.prank(funder);
        try ledger.withdrawPool(id) {
            if (want != bytes4(0)) ghost_wrongRefusal += 1;
            uint256 got = registry.creditOf(funder) - creditBefore;
            if (funded == 0 || got != balance * part / funded) ghost_payMismatch += 1;
            ghost_withdrawn[r] += got;
            ghost_fundedBy[r][funder] = 0;
            ghost_poolWithdrawals += 1;
        } catch (bytes memory reason) {
            if (want == bytes4(0) || bytes4(reason) != want) ghost_wrongRefusal += 1;
        }
    }

    /// @dev Finalizes every committed step of run `r` that no challenge holds (waiting out
    /// the windows), stopping at the first held one.
    function _finalizeDue(uint256 r) internal {
        uint256 id = _runIds[r];
        (, uint64 headStep) = ledger.runHead(id);
        uint64 first = ledger.finalizedStep(id) + 1;
        uint64 last = first - 1;
        while (last < headStep && ledger.stepInfo(id, last + 1).openChallenges == 0) {
            ++last;
        }
        if (last < first) return;
        uint256 deadline = ledger.stepInfo(id, last).committedAt + WINDOW;
        if (block.timestamp <= deadline) vm.warp(deadline + 1);
        if (r == 2) {
            for (uint64 step = first; step <= last; ++step) {
                ledger.finalize(id, step);
            }
        } else {
            _finalizeAndPay(r, first, last);
        }
    }

    // ---------------------------------------------------------------- challenges and slashes

    /// @notice The verifier challenges a slot of a challengeable step of run 0 or 1.
    function challenge(uint256 runSeed, uint256 stepSeed, uint256 slotSeed) external {
        uint256 r = runSeed % 2;
        uint256 id = _runIds[r];
        (, uint64 headStep) = ledger.runHead(id);
        uint64 finalized = ledger.finalizedStep(id);
        if (headStep <= finalized) return;
        uint64 step = uint64(bound(stepSeed, finalized + 1, headStep));
        if (block.timestamp > ledger.stepInfo(id, step).committedAt + WINDOW) return;
        Record storage rec = _records[r][step];
        uint256 slot = bound(slotSeed, 0, rec.signers.length - 1);
        uint32 replica = rec.set == 3 ? uint32(slot / 2) : (rec.set == 1 ? 0 : 1);
        uint256 bond = _minStakes[r];
        vm.prank(verifier);
        ledger.openChallenge{value: bond}(
            id, step, replica, uint32(slot % 2), rec.set, rec.signers, keccak256(abi.encodePacked(rec.shards)), 0
        );
        _openChallenges.push(ledger.challengeCount());
        ghost_in += bond;
        ghost_bonds += bond;
        ghost_openChallengesAgainst[rec.signers[slot]] += 1;
    }

    /// @notice Two arbiters rule on an open challenge; an upheld one slashes the node (once
    /// per offence), rolls the run back past the step, and marks those records unpayable.
    function resolve(uint256 idSeed, bool upheld) external {
        if (_openChallenges.length == 0) return;
        uint256 cid = _takeOpenChallenge(idSeed);
        ITrainingLedger.Challenge memory c = ledger.challenge(cid);
        uint256 r = c.runId == _runIds[0] ? 0 : 1;
        (, uint64 headBefore) = ledger.runHead(c.runId);
        bytes32 offence = ledger.offenceId(1, c.runId, c.step, c.replica, c.stage, bytes32(uint256(c.epoch)), c.node);
        uint256 held = _stakeTotal(c.node);

        ledger.resolveChallenge(cid, upheld, _verdicts(cid, upheld));

        if (upheld) {
            ghost_upheld += 1;
            ghost_badRecord[r][c.step][c.epoch] = true;
            (, uint64 headAfter) = ledger.runHead(c.runId);
            for (uint64 s = headAfter + 1; s <= headBefore; ++s) {
                ghost_badRecord[r][s][_records[r][s].epoch] = true;
            }
            if (!ghost_offenceSlashed[offence]) _slashed(r, c.node, offence, held);
        }
        ghost_bonds -= c.bond;
        ghost_openChallengesAgainst[c.node] -= 1;
    }

    /// @notice Nobody rules on an open challenge within the resolution period: it expires.
    function expire(uint256 idSeed) external {
        if (_openChallenges.length == 0) return;
        uint256 cid = _takeOpenChallenge(idSeed);
        ITrainingLedger.Challenge memory c = ledger.challenge(cid);
        uint256 deadline = uint256(c.openedAt) + ledger.resolutionPeriod();
        if (block.timestamp <= deadline) vm.warp(deadline + 1);
        ledger.expireChallenge(cid);
        ghost_bonds -= c.bond;
        ghost_openChallengesAgainst[c.node] -= 1;
    }

    /// @notice Reports an equivocation of a node in any run, with contributions drawn from a
    /// tiny set so offences repeat: refused for a node that never was a member and for an
    /// offence already slashed; a node that left stays answerable.
    function equivocate(uint256 runSeed, uint256 nodeSeed, uint256 stepSeed, uint256 x, uint256 y) external {
        uint256 r = bound(runSeed, 0, RUNS - 1);
        uint256 i = bound(nodeSeed, 0, NODES - 1);
        (x, y) = (bound(x, 1, 3), bound(y, 1, 3));
        if (x == y) return;
        address node = _nodes[i];
        uint64 step = uint64(bound(stepSeed, 1, 3));
        ITrainingLedger.Attestation memory a = _attest(r, _nodeKeys[i], step, GENESIS, 0, 0, 3, bytes32(x));
        ITrainingLedger.Attestation memory b = _attest(r, _nodeKeys[i], step, GENESIS, 0, 0, 3, bytes32(y));
        bytes32 offence = ledger.offenceId(0, _runIds[r], step, 0, 0, GENESIS, node);
        bytes4 want = bytes4(0);
        if (ghost_status[r][node] == NONE) want = ITrainingLedger.LedgerNotMember.selector;
        else if (ghost_offenceSlashed[offence]) want = ITrainingLedger.LedgerAlreadySlashed.selector;
        uint256 held = _stakeTotal(node);
        uint256 creditBefore = registry.creditOf(address(this));
        try ledger.reportEquivocation(_runIds[r], step, GENESIS, a, b) {
            if (want != bytes4(0)) ghost_wrongRefusal += 1;
            _slashed(r, node, offence, held);
            if (registry.creditOf(address(this)) - creditBefore != held * REPORTER_BPS / 10_000) {
                ghost_payMismatch += 1;
            }
        } catch (bytes memory reason) {
            if (want == bytes4(0) || bytes4(reason) != want) ghost_wrongRefusal += 1;
        }
    }

    /// @dev Books a slash of `node`'s whole stake (`held`, active and unbonding) for
    /// `offence` in run `r`: the reporter's share is credited, the rest joins the run's pool
    /// as its creator's funding.
    function _slashed(uint256 r, address node, bytes32 offence, uint256 held) internal {
        uint256 income = held - held * REPORTER_BPS / 10_000;
        ghost_offenceSlashed[offence] = true;
        ghost_slashedAt[node] = uint64(block.timestamp);
        ghost_slashIncome[r] += income;
        ghost_fundedBy[r][_creators[r]] += income;
        ghost_slashes += 1;
    }

    // ---------------------------------------------------------------- stakes and claims

    function stake(uint256 nodeSeed, uint256 amount) external {
        uint256 i = bound(nodeSeed, 0, NODES - 1);
        if (_unbonding(_nodes[i])) return;
        _stakeFor(i, bound(amount, 0.1 ether, 2 ether));
    }

    /// @notice An operator unbonds its node: refused while it is unbonding, has no stake, or
    /// has stake locked by a run it joined.
    function unbond(uint256 nodeSeed) external {
        uint256 i = bound(nodeSeed, 0, NODES - 1);
        address node = _nodes[i];
        bytes4 want = bytes4(0);
        if (_unbonding(node)) want = INodeRegistry.RegistryUnbonding.selector;
        else if (registry.stakeOf(node) == 0) want = INodeRegistry.RegistryNothingToUnbond.selector;
        else if (expectedLocked(node) != 0) want = INodeRegistry.RegistryStakeLocked.selector;
        vm.prank(_operator(i));
        try registry.unbond(node) {
            if (want != bytes4(0)) ghost_wrongRefusal += 1;
        } catch (bytes memory reason) {
            if (want == bytes4(0) || bytes4(reason) != want) ghost_wrongRefusal += 1;
        }
    }

    function withdraw(uint256 nodeSeed) external {
        uint256 i = bound(nodeSeed, 0, NODES - 1);
        (uint256 amount, uint64 releaseAt) = registry.unbondingOf(_nodes[i]);
        if (releaseAt == 0 || ghost_openChallengesAgainst[_nodes[i]] != 0) return;
        if (block.timestamp < releaseAt) vm.warp(releaseAt);
        vm.prank(_operator(i));
        registry.withdraw(_nodes[i]);
        ghost_out += amount;
    }

    function claim(uint256 payeeSeed) external {
        address payee = _payees[bound(payeeSeed, 0, _payees.length - 1)];
        uint256 amount = registry.creditOf(payee);
        if (amount == 0) return;
        vm.prank(payee);
        registry.claim();
        ghost_out += amount;
    }

    function warp(uint256 seconds_) external {
        vm.warp(block.timestamp + bound(seconds_, 1, 2 * WINDOW));
    }

    // ---------------------------------------------------------------- helpers

    function _takeOpenChallenge(uint256 seed) internal returns (uint256 id) {
        uint256 index = bound(seed, 0, _openChallenges.length - 1);
        id = _openChallenges[index];
        _openChallenges[index] = _openChallenges[_openChallenges.length - 1];
        _openChallenges.pop();
    }

    function _operator(uint256 i) internal pure returns (address) {
        return vm.addr(0xE100 + i);
    }

    function _unbonding(address node) internal view returns (bool) {
        (, uint64 releaseAt) = registry.unbondingOf(node);
        return releaseAt != 0;
    }

    function _stakeTotal(address node) internal view returns (uint256) {
        (uint256 unbonding,) = registry.unbondingOf(node);
        return registry.stakeOf(node) + unbonding;
    }

    /// @dev Tops `node`'s active stake up to run `r`'s minimum (a slash leaves it at zero).
    function _topUp(uint256 r, address node) internal {
        uint256 staked = registry.stakeOf(node);
        if (staked < _minStakes[r] && !_unbonding(node)) _stakeFor(_indexOf[node], _minStakes[r] - staked);
    }

    function _stakeFor(uint256 i, uint256 amount) internal {
        address operator = _operator(i);
        vm.deal(operator, operator.balance + amount);
        vm.prank(operator);
        registry.stake{value: amount}(_nodes[i]);
        ghost_in += amount;
    }

    function _sign(uint256 key, bytes32 digest) internal pure returns (bytes memory) {
        (uint8 v, bytes32 rs, bytes32 s) = vm.sign(key, digest);
        return abi.encodePacked(rs, s, v);
    }

    function _attest(
        uint256 r,
        uint256 key,
        uint64 step,
        bytes32 parent,
        uint32 replica,
        uint32 stage,
        uint256 set,
        bytes32 salt
    ) internal view returns (ITrainingLedger.Attestation memory a) {
        a.replica = replica;
        a.stage = stage;
        a.replicaSet = set;
        a.contribution = keccak256(abi.encode(salt, step, replica, stage));
        a.dataShard = keccak256(abi.encode("shard", step, replica));
        a.codeHash = keccak256("code");
        a.lossMicros = -1;
        a.newShard = keccak256(abi.encode("new shard", salt, step, stage));
        (a.r, a.vs) = vm.signCompact(key, ledger.contributionDigest(_runIds[r], step, parent, a));
    }

    /// @dev Verdicts by the first two arbiters, sorted by address.
    function _verdicts(uint256 id, bool upheld) internal view returns (bytes[] memory sigs) {
        bytes32 digest = ledger.verdictDigest(id, upheld);
        (uint256 k0, uint256 k1) = (_arbiterKeys[0], _arbiterKeys[1]);
        if (vm.addr(k0) > vm.addr(k1)) (k0, k1) = (k1, k0);
        sigs = new bytes[](2);
        sigs[0] = _sign(k0, digest);
        sigs[1] = _sign(k1, digest);
    }
}
