"""Content addressing: CIDs, DAG-CBOR and dag-pb blocks, UnixFS files and directories, the
on-disk blockstore and its retention, CAR archives, the IPFS daemon, manifests and prepared
datasets. Imports nothing from `lineage.chain` or `lineage.audit`."""
