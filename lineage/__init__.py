"""Lineage: what a run leaves behind and how it is checked. Three subpackages, each
importing only the ones before it: `lineage.store` (content addressing), `lineage.chain`
(the ledger, its signed messages and the run record) and `lineage.audit` (queries, the
verifier, replays, diffs, reports). `lineage.errors` holds the exceptions all three raise."""
