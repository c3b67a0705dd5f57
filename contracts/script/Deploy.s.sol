// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Script, console2} from "forge-std/Script.sol";

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";

/// @notice Deploys NodeRegistry, then a TrainingLedger bound to it.
/// @dev For forge users; the Python side deploys from out/<Name>.sol/<Name>.json itself
/// (lineage/chain/ledger.py `Ledger.deploy`), with the same defaults.
///
///   DLX_TREASURY=0x... forge script script/Deploy.s.sol --rpc-url http://127.0.0.1:PORT \
///       --private-key $KEY --broadcast
///
/// Environment: DLX_TREASURY (default: the burn address 0x...dEaD), DLX_REPORTER_BPS
/// (default 5000), DLX_UNBONDING_DELAY seconds (default 7 days).
contract Deploy is Script {
    function run() external returns (NodeRegistry registry, TrainingLedger ledger) {
        address treasury = vm.envOr("DLX_TREASURY", address(0xdEaD));
        uint256 reporterBps = vm.envOr("DLX_REPORTER_BPS", uint256(5_000));
        uint64 delay = uint64(vm.envOr("DLX_UNBONDING_DELAY", uint256(7 days)));
        vm.startBroadcast();
        registry = new NodeRegistry(treasury, reporterBps, delay);
        ledger = new TrainingLedger(registry);
        registry.bindLedger(address(ledger));
        vm.stopBroadcast();
        console2.log("NodeRegistry", address(registry));
        console2.log("TrainingLedger", address(ledger));
    }
}
