"""The fault campaign's parts: processes, faults, the upstream ledger and the verdict."""
