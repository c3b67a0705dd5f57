"""Auditing a run: lineage queries (`query`), the verifier (`verify`) and its replays
(`replay`), checkpoint diffs (`diff`), HTML reports (`report`), and the evidence behind a
challenge or an equivocation report (`evidence`). Built on `lineage.store` and
`lineage.chain`; nothing below imports it."""
