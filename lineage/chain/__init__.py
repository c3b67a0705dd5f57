"""The chain side of a run: the JSON-RPC client and revert decoding (`client`), the typed
ledger client and its records (`ledger`), the NodeRegistry client (`registry`), the EIP-712
messages and their signatures (`attest`, the one module that answers where a commit is
signed), the local anvil (`anvil`) and the run record (`runrecord`). Imports
`lineage.store`, never `lineage.audit`."""
