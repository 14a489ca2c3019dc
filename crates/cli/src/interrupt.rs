//! SIGINT and SIGTERM during a running command: the command's
//! [`CancelToken`] fires, so children stop (their partial usage billed, the
//! unit finalised) and the command exits 130 or 143, instead of the process
//! dying with its unit left `running`.

use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread::JoinHandle;

use retinue_delegate::CancelToken;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::{Handle, Signals};

/// Watches SIGINT and SIGTERM for as long as it lives.
pub(crate) struct Interrupts {
    fired: Arc<AtomicI32>,
    handle: Option<Handle>,
    thread: Option<JoinHandle<()>>,
}

impl Interrupts {
    /// Cancels `cancel` on the first SIGINT or SIGTERM. Where signals
    /// cannot be watched, the default (the process dies) stays, and a
    /// warning says so.
    pub(crate) fn watch(cancel: &CancelToken) -> Interrupts {
        let fired = Arc::new(AtomicI32::new(0));
        let mut signals = match Signals::new([SIGINT, SIGTERM]) {
            Ok(s) => s,
            Err(e) => {
                log::warn!("cannot watch SIGINT/SIGTERM ({e}); an interrupt kills the command");
                return Interrupts { fired, handle: None, thread: None };
            }
        };
        let handle = signals.handle();
        let (token, seen) = (cancel.clone(), Arc::clone(&fired));
        let thread = std::thread::Builder::new().name("interrupts".to_owned()).spawn(move || {
            for signal in signals.forever() {
                if seen.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                    eprintln!("retinue: interrupted; stopping the children and recording the unit");
                }
                token.cancel();
            }
        });
        match thread {
            Ok(t) => Interrupts { fired, handle: Some(handle), thread: Some(t) },
            Err(e) => {
                log::warn!("cannot watch SIGINT/SIGTERM ({e}); an interrupt kills the command");
                handle.close();
                Interrupts { fired, handle: None, thread: None }
            }
        }
    }

    /// The exit code for the signal that fired (128 + its number: 130 for
    /// SIGINT, 143 for SIGTERM), if one did.
    pub(crate) fn exit_code(&self) -> Option<u8> {
        match self.fired.load(Ordering::SeqCst) {
            0 => None,
            n => u8::try_from(128 + n).ok(),
        }
    }
}

impl Drop for Interrupts {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            h.close();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
