//! Injectable time: every timestamp the store writes comes from a [`Clock`].

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of epoch seconds.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait Clock: Send + Sync {
    /// Seconds since the Unix epoch.
    fn now(&self) -> f64;
}

/// The wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> f64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
    }
}

/// A clock that only moves when told to (tests, demos, simulations).
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<f64>,
}

impl ManualClock {
    /// A clock stopped at `start` epoch seconds.
    pub fn new(start: f64) -> Self {
        ManualClock { now: Mutex::new(start) }
    }

    /// Moves the clock forward (or backward) by `secs`.
    pub fn advance(&self, secs: f64) {
        let mut now = self.now.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *now += secs;
    }

    /// Sets the clock to `at`.
    pub fn set(&self, at: f64) {
        let mut now = self.now.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *now = at;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> f64 {
        *self.now.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Formats epoch seconds as ISO-8601 UTC (`2026-11-29T15:31:58Z`).
pub fn iso8601(epoch: f64) -> String {
    if !epoch.is_finite() {
        return "unknown".to_owned();
    }
    // Truncation to whole seconds is intended.
    let secs = epoch.floor() as i64;
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (h, m, s) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{m:02}:{s:02}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso8601_known_instants() {
        assert_eq!(iso8601(0.0), "1970-01-01T00:00:00Z");
        assert_eq!(iso8601(1_796_052_718.9), "2026-11-30T15:31:58Z");
        assert_eq!(iso8601(951_782_400.0), "2000-02-29T00:00:00Z");
        assert_eq!(iso8601(f64::NAN), "unknown");
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = ManualClock::new(10.0);
        assert!((c.now() - 10.0).abs() < f64::EPSILON);
        c.advance(5.5);
        assert!((c.now() - 15.5).abs() < f64::EPSILON);
        c.set(1.0);
        assert!((c.now() - 1.0).abs() < f64::EPSILON);
    }
}
