//! The closed vocabularies of the registry as enums: a unit's state, a
//! child's status and exit reason, a child's role.
//!
//! Each enum reads every string: a value written by hermes (or a newer
//! Retinue) that this binary does not know is kept verbatim in `Other` and
//! written back unchanged, never rejected or rewritten. The `#[default]`
//! of each is the value a fresh record starts with.

use std::fmt;

macro_rules! vocabulary {
    (
        $(#[$meta:meta])*
        $name:ident { $( $(#[$vmeta:meta])* $variant:ident => $text:literal, )+ }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
            /// A value this binary does not know, kept verbatim.
            Other(String),
        }

        impl $name {
            /// The stored text.
            pub fn as_str(&self) -> &str {
                match self {
                    $( $name::$variant => $text, )+
                    $name::Other(s) => s,
                }
            }

            /// Reads a stored text (exact match; anything else is `Other`).
            pub fn parse(text: &str) -> $name {
                match text {
                    $( $text => $name::$variant, )+
                    other => $name::Other(other.to_owned()),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl From<&str> for $name {
            fn from(text: &str) -> $name {
                $name::parse(text)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<$name, D::Error> {
                let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                Ok($name::parse(&text))
            }
        }
    };
}

vocabulary! {
    /// A unit's (`async_delegations.state`) lifecycle state.
    UnitState {
        /// Recorded, children not started yet.
        #[default]
        Pending => "pending",
        /// Children running.
        Running => "running",
        /// Children done, results being written (still live: recovery and
        /// the retention rules treat it like `running`).
        Finalizing => "finalizing",
        /// At least one child completed.
        Completed => "completed",
        /// Every child failed.
        Failed => "failed",
        /// Interrupted.
        Interrupted => "interrupted",
        /// Errored.
        Error => "error",
        /// Its owner died; recovery could not tell how it ended.
        Unknown => "unknown",
    }
}

vocabulary! {
    /// A child's status in a result entry (semantics §6.5) and the ledger.
    ChildStatus {
        /// A non-empty final answer without error.
        Completed => "completed",
        /// No usable answer.
        #[default]
        Failed => "failed",
        /// An error ended it.
        Error => "error",
        /// It was interrupted.
        Interrupted => "interrupted",
        /// It ran out of time.
        Timeout => "timeout",
    }
}

vocabulary! {
    /// Why a child's run stopped (also a child session's `end_reason`).
    ExitReason {
        /// It gave its final answer.
        #[default]
        Completed => "completed",
        /// It was interrupted or cancelled.
        Interrupted => "interrupted",
        /// It used its `max_iterations`.
        MaxIterations => "max_iterations",
        /// Its deadline passed.
        Timeout => "timeout",
        /// An error ended it.
        Error => "error",
        /// It would have crossed its budget.
        Budget => "budget",
        /// Its parent cancelled it (`retinue cancel`, `cancel_subagent`,
        /// `tasks/cancel`).
        Cancelled => "cancelled",
    }
}

vocabulary! {
    /// Why a session ended (`sessions.end_reason`): a child's [`ExitReason`],
    /// or hermes's own reasons (`compression` ends a session that a
    /// compression continuation carries on).
    EndReason {
        /// The session was compressed into a continuation.
        Compression => "compression",
        /// It gave its final answer.
        #[default]
        Completed => "completed",
        /// It was interrupted or cancelled.
        Interrupted => "interrupted",
        /// It used its `max_iterations`.
        MaxIterations => "max_iterations",
        /// Its deadline passed.
        Timeout => "timeout",
        /// An error ended it.
        Error => "error",
        /// It would have crossed its budget.
        Budget => "budget",
        /// Its parent cancelled it.
        Cancelled => "cancelled",
    }
}

impl From<&ExitReason> for EndReason {
    fn from(r: &ExitReason) -> EndReason {
        EndReason::parse(r.as_str())
    }
}

vocabulary! {
    /// How a budget reservation was settled (`retinue_budget_reservations`'s
    /// reason): released, settled against the ledger, or kept as spent.
    SettleReason {
        /// The run ended and its ledger rows were written.
        #[default]
        Settled => "settled",
        /// Released: nothing ran.
        NothingRan => "released: nothing ran",
        /// Released: only the call's own limit applied, metered in memory.
        CallLimitOnly => "released: the call's own limit is metered in memory",
        /// Kept as spent: model calls were still in flight.
        CallsInFlight => "kept as spent: calls still in flight",
        /// Kept as spent: the ledger rows could not be written.
        LedgerWriteFailed => "kept as spent: the ledger write failed",
        /// Kept as spent: the owning process is gone.
        OwnerGone => "kept as spent: owner gone",
        /// Kept as spent: its run ended on an unexpected path (a panic, a
        /// thread that could not start) after spending.
        Abandoned => "kept as spent: the run was abandoned",
    }
}

vocabulary! {
    /// A child's role.
    Role {
        /// Cannot delegate further.
        #[default]
        Leaf => "leaf",
        /// May delegate (when the depth allows).
        Orchestrator => "orchestrator",
    }
}

impl UnitState {
    /// Whether the unit is still in flight (pending or running).
    pub fn is_live(&self) -> bool {
        matches!(self, UnitState::Pending | UnitState::Running | UnitState::Finalizing)
    }
}

impl ChildStatus {
    /// The unit state a set of children gives (any completed → completed,
    /// else interrupted, else error, else failed).
    pub fn unit_state<'a>(statuses: impl IntoIterator<Item = &'a ChildStatus>) -> UnitState {
        let (mut completed, mut interrupted, mut error) = (false, false, false);
        for s in statuses {
            match s {
                ChildStatus::Completed => completed = true,
                ChildStatus::Interrupted => interrupted = true,
                ChildStatus::Error => error = true,
                _ => {}
            }
        }
        if completed {
            UnitState::Completed
        } else if interrupted {
            UnitState::Interrupted
        } else if error {
            UnitState::Error
        } else {
            UnitState::Failed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_values_round_trip_verbatim() {
        for text in ["completed", "max_iterations", "weird-hermes-value", "", " running "] {
            assert_eq!(ExitReason::parse(text).as_str(), text);
            assert_eq!(UnitState::parse(text).as_str(), text);
            assert_eq!(ChildStatus::parse(text).as_str(), text);
            assert_eq!(Role::parse(text).as_str(), text);
            assert_eq!(EndReason::parse(text).as_str(), text);
            assert_eq!(SettleReason::parse(text).as_str(), text);
        }
        assert!(UnitState::parse("finalizing").is_live(), "finalizing is live, as the SQL says");
        assert_eq!(EndReason::from(&ExitReason::MaxIterations), EndReason::MaxIterations);
        assert_eq!(UnitState::parse("running"), UnitState::Running);
        assert_eq!(UnitState::parse(" running "), UnitState::Other(" running ".into()));
    }

    #[test]
    fn serde_uses_the_stored_text() {
        let v = serde_json::to_value(ExitReason::MaxIterations).ok();
        assert_eq!(v, Some(serde_json::json!("max_iterations")));
        let back: Option<UnitState> = serde_json::from_value(serde_json::json!("later")).ok();
        assert_eq!(back, Some(UnitState::Other("later".into())));
    }

    #[test]
    fn unit_state_rule() {
        use ChildStatus as S;
        assert_eq!(ChildStatus::unit_state(&[S::Error, S::Completed]), UnitState::Completed);
        assert_eq!(ChildStatus::unit_state(&[S::Error, S::Interrupted]), UnitState::Interrupted);
        assert_eq!(ChildStatus::unit_state(&[S::Timeout, S::Error]), UnitState::Error);
        assert_eq!(ChildStatus::unit_state(&[S::Timeout]), UnitState::Failed);
        assert_eq!(ChildStatus::unit_state(&[]), UnitState::Failed);
    }
}
