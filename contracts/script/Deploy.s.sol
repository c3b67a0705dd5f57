// SPDX-License-Identifier: MIT
pragma solidity ^0.8.24;

import {Script, console2} from "forge-std/Script.sol";

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";

/// @notice Deploys NodeRegistry, then a TrainingLedger bound to it.
/// @dev For forge users; the Python side deploys from out/<Name>.sol/<Name>.json itself.
///
///   forge script script/Deploy.s.sol --rpc-url http://127.0.0.1:PORT \
///       --private-key $KEY --broadcast
contract Deploy is Script {
    function run() external returns (NodeRegistry registry, TrainingLedger ledger) {
        vm.startBroadcast();
        registry = new NodeRegistry();
        ledger = new TrainingLedger(registry);
        vm.stopBroadcast();
        console2.log("NodeRegistry", address(registry));
        console2.log("TrainingLedger", address(ledger));
    }
}
