//! The plans of the hot statements exactly as the store runs them: a second
//! `PgStore` whose connections load `auto_explain` at NOTICE level
//! (`EXPLAIN (ANALYZE, BUFFERS)` of every statement, prepared ones with the
//! plan the server chose for them), the notices captured from the log
//! records the `postgres` crate makes of them.

use std::sync::Mutex;

use crate::limits::Res;

/// The captured `auto_explain` notices.
struct Capture {
    notices: Mutex<Vec<String>>,
}

static CAPTURE: Capture = Capture { notices: Mutex::new(Vec::new()) };

impl log::Log for Capture {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.target().starts_with("postgres")
    }

    fn log(&self, r: &log::Record<'_>) {
        let text = r.args().to_string();
        if self.enabled(r.metadata()) && text.contains("Query Text:") {
            self.notices.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(text);
        }
    }

    fn flush(&self) {}
}

/// Installs the capturing logger (once per process).
pub(crate) fn install() -> Res<()> {
    log::set_logger(&CAPTURE).map_err(|e| format!("a logger is installed already: {e}"))?;
    log::set_max_level(log::LevelFilter::Info);
    Ok(())
}

/// `url` with the connection options that make every statement's plan a notice.
pub(crate) fn url_with_auto_explain(url: &str) -> String {
    let options = [
        "session_preload_libraries=auto_explain",
        "auto_explain.log_min_duration=0",
        "auto_explain.log_analyze=on",
        "auto_explain.log_buffers=on",
        "auto_explain.log_timing=on",
        "auto_explain.log_level=notice",
    ]
    .iter()
    .map(|o| format!("-c%20{}", o.replace('=', "%3D")))
    .collect::<Vec<_>>()
    .join("%20");
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options={options}")
}

/// The plans of the statements of one call of `f`, after five untimed
/// calls (so a prepared statement runs on the plan it settles on).
pub(crate) fn plans(mut f: impl FnMut() -> Res<()>) -> Res<Vec<String>> {
    for _ in 0..5 {
        f()?;
    }
    CAPTURE.notices.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clear();
    f()?;
    Ok(std::mem::take(
        &mut *CAPTURE.notices.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
    ))
}
