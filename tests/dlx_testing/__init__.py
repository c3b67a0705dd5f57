"""Test-only extensions of `dlx`, never imported by production code: the attack harness
(`dlx_testing.cheat`), which the tests' conftest names in `DLX_TEST_EXTENSION`."""
