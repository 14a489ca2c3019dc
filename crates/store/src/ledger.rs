//! The usage ledger on `delegation_child_usage` (spec §7).
