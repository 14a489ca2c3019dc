//! The writers' queue between processes (issue #41): a FIFO ticket lock
//! made of open-file-description record locks on a small file beside the
//! database (`<name>-retinue-writers`), Linux only.
//!
//! Each process's writer at the front of its [`crate::gate::WriterGate`]
//! takes the next ticket (a counter in the file's first 8 bytes, under a
//! lock on byte 0) and write-locks the ticket's own byte; it may write
//! once no ticket below its own is locked (a read lock on the whole range
//! below it is grantable), and unlocks its byte when its transaction ends.
//! So the processes' writers take turns in ticket order, and a waiting one
//! sleeps in the kernel until the one ahead leaves instead of probing the
//! SQLite lock: a release wakes the next writer at once.
//!
//! Faults: the kernel drops a process's locks when it dies, however it
//! dies (SIGKILL included), so a killed holder or waiter never blocks the
//! queue; a waiter that gives up unlocks its byte, so it never holds up
//! the ones behind it. The counter is only a source of distinct tickets:
//! losing it (a crash, a deleted file) loses nothing. Programs that do not
//! take part (hermes, an older Retinue) still meet the queue's writers at
//! SQLite's lock, through the busy handler.
//!
//! The blocking wait has no timeout of its own, so one helper thread per
//! queue waits on the writer's behalf and the writer waits for its answer
//! with the busy timeout.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::fcntl::{FcntlArg, fcntl};
use nix::libc;

/// Byte 0 guards the counter; tickets lock the bytes from here.
const FIRST_TICKET_BYTE: i64 = 8;

/// One database file's queue between processes.
pub(crate) struct ProcessQueue {
    file: Arc<File>,
    helper: Mutex<Helper>,
}

/// The helper thread's two channels: tickets to wait for, and the tickets
/// whose turn came (or the wait's failure).
struct Helper {
    wait_for: Sender<u64>,
    turns: Receiver<nix::Result<u64>>,
}

fn byte(ticket: u64) -> i64 {
    // Tickets stay far below 2^62: a billion writes a second for a century.
    FIRST_TICKET_BYTE.saturating_add(i64::try_from(ticket & ((1 << 62) - 1)).unwrap_or(0))
}

fn flock(kind: libc::c_int, start: i64, len: i64) -> libc::flock {
    libc::flock {
        l_type: i16::try_from(kind).unwrap_or(0),
        l_whence: i16::try_from(libc::SEEK_SET).unwrap_or(0),
        l_start: start,
        l_len: len,
        // Set by the kernel for a lock found by F_OFD_GETLK; 0 otherwise.
        l_pid: 0,
    }
}

/// Takes (`wait`: blocking) or releases a record lock of the file's open
/// description on `len` bytes from `start`.
fn set(file: &File, kind: libc::c_int, start: i64, len: i64, wait: bool) -> nix::Result<()> {
    let l = flock(kind, start, len);
    let arg = if wait { FcntlArg::F_OFD_SETLKW(&l) } else { FcntlArg::F_OFD_SETLK(&l) };
    fcntl(file, arg).map(drop)
}

/// Whether no ticket below `ticket` is locked (by another description).
fn front(file: &File, ticket: u64) -> nix::Result<bool> {
    let mut l = flock(libc::F_RDLCK, FIRST_TICKET_BYTE, byte(ticket) - FIRST_TICKET_BYTE);
    if l.l_len == 0 {
        return Ok(true);
    }
    fcntl(file, FcntlArg::F_OFD_GETLK(&mut l))?;
    Ok(i32::from(l.l_type) == libc::F_UNLCK)
}

/// Blocks until no ticket below `ticket` is locked.
fn wait_front(file: &File, ticket: u64) -> nix::Result<u64> {
    let len = byte(ticket) - FIRST_TICKET_BYTE;
    if len > 0 {
        set(file, libc::F_RDLCK, FIRST_TICKET_BYTE, len, true)?;
        set(file, libc::F_UNLCK, FIRST_TICKET_BYTE, len, false)?;
    }
    Ok(ticket)
}

impl ProcessQueue {
    /// The queue of the database at `db`, its file created if needed;
    /// `None` where it cannot be (a read-only directory): writers then meet
    /// at SQLite's lock only.
    pub(crate) fn open(db: &Path) -> Option<ProcessQueue> {
        let mut name = db.file_name()?.to_os_string();
        if name.is_empty() || name == ":memory:" {
            return None;
        }
        name.push("-retinue-writers");
        let path = db.with_file_name(name);
        // Never through a link, never anything but a small regular file of
        // ours: the counter is written at offset 0 of whatever opens.
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(&path)
            .and_then(|f| {
                let meta = f.metadata()?;
                if meta.is_file() && meta.len() <= 8 {
                    Ok(f)
                } else {
                    Err(std::io::Error::other("not a writers' queue file (a planted file?)"))
                }
            });
        let file = match opened {
            Ok(f) => Arc::new(f),
            Err(e) => {
                log::warn!(
                    "no writers' queue at {} ({e}): writers of several processes meet at \
                     SQLite's lock only",
                    path.display()
                );
                return None;
            }
        };
        let (wait_for, requests) = channel::<u64>();
        let (answers, turns) = channel();
        let waiting = file.clone();
        let spawned =
            std::thread::Builder::new().name("retinue-writers-queue".into()).spawn(move || {
                // Ends when the queue (its sender) is dropped.
                for ticket in requests {
                    if answers.send(wait_front(&waiting, ticket)).is_err() {
                        break;
                    }
                }
            });
        if let Err(e) = spawned {
            log::debug!("no writers' queue at {}: {e}", path.display());
            return None;
        }
        Some(ProcessQueue { file, helper: Mutex::new(Helper { wait_for, turns }) })
    }

    /// Leaves the turn of `ticket` (or gives the ticket up): the next
    /// ticket's writer proceeds.
    pub(crate) fn leave(&self, ticket: u64) {
        // Unlocking a lock this description holds does not fail.
        let _ = set(&self.file, libc::F_UNLCK, byte(ticket), 1, false);
    }

    /// Takes a ticket and waits for its turn, at most `timeout`; the turn
    /// lasts until [`ProcessQueue::leave`]. `Ok(None)`: the queue failed
    /// (an I/O error on its file); the writer goes on without it, to
    /// SQLite's lock. `Err`: the turn did not come within `timeout`; the
    /// milliseconds waited.
    pub(crate) fn enter(&self, timeout: Duration) -> Result<Option<u64>, u64> {
        let started = Instant::now();
        let Ok(ticket) = self.ticket() else { return Ok(None) };
        match front(&self.file, ticket) {
            Ok(true) => return Ok(Some(ticket)),
            Ok(false) => {}
            Err(_) => {
                self.leave(ticket);
                return Ok(None);
            }
        }
        let helper = self.helper.lock().unwrap_or_else(PoisonError::into_inner);
        // Answers for tickets given up earlier are stale.
        while helper.turns.try_recv().is_ok() {}
        if helper.wait_for.send(ticket).is_err() {
            self.leave(ticket);
            return Ok(None);
        }
        loop {
            let left = timeout.saturating_sub(started.elapsed());
            match helper.turns.recv_timeout(left) {
                Ok(Ok(t)) if t == ticket => return Ok(Some(ticket)),
                Ok(Ok(_)) => {}
                Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => {
                    self.leave(ticket);
                    return Ok(None);
                }
                Err(RecvTimeoutError::Timeout) => {
                    // Given up: the ones behind do not wait for a writer
                    // that left.
                    self.leave(ticket);
                    return Err(u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX));
                }
            }
        }
    }

    /// The next ticket, its byte locked by this description.
    fn ticket(&self) -> nix::Result<u64> {
        set(&self.file, libc::F_WRLCK, 0, 1, true)?;
        let taken = (|| {
            let mut raw = [0u8; 8];
            // A short or failed read (a new file): the counter starts at 0.
            let n = self.file.read_at(&mut raw, 0).unwrap_or(0);
            let ticket = if n == 8 { u64::from_le_bytes(raw) } else { 0 };
            self.file
                .write_all_at(&ticket.wrapping_add(1).to_le_bytes(), 0)
                .map_err(|e| nix::errno::Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))?;
            set(&self.file, libc::F_WRLCK, byte(ticket), 1, false)?;
            Ok(ticket)
        })();
        let _ = set(&self.file, libc::F_UNLCK, 0, 1, false);
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second open file description: as another process would hold.
    fn other(dir: &Path) -> ProcessQueue {
        ProcessQueue::open(&dir.join("state.db")).expect("queue")
    }

    #[test]
    fn tickets_are_served_in_order_across_descriptions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = other(dir.path());
        let b = other(dir.path());
        let first = a.enter(Duration::from_secs(5)).expect("free").expect("queue works");
        // b's ticket is behind a's: it times out while a holds its turn.
        let e = b.enter(Duration::from_millis(30)).expect_err("waits for a");
        assert!(e >= 30, "gave up after {e} ms");
        // b gave up and unlocked its byte: a third writer waits only for a.
        let c = other(dir.path());
        let c_turn = std::thread::scope(|s| {
            let h = s.spawn(|| c.enter(Duration::from_secs(5)));
            std::thread::sleep(Duration::from_millis(50));
            assert!(!h.is_finished(), "c went ahead of a");
            a.leave(first);
            h.join().expect("c")
        });
        assert!(matches!(c_turn, Ok(Some(2))), "{c_turn:?}");
    }

    #[test]
    fn a_planted_link_or_foreign_file_is_not_used() {
        let dir = tempfile::tempdir().expect("tempdir");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").expect("victim");
        std::os::unix::fs::symlink(&victim, dir.path().join("a.db-retinue-writers")).expect("link");
        assert!(ProcessQueue::open(&dir.path().join("a.db")).is_none());
        std::fs::write(dir.path().join("b.db-retinue-writers"), b"not a counter of ours")
            .expect("foreign file");
        assert!(ProcessQueue::open(&dir.path().join("b.db")).is_none());
        std::fs::create_dir(dir.path().join("c.db-retinue-writers")).expect("a directory");
        assert!(ProcessQueue::open(&dir.path().join("c.db")).is_none());
        assert_eq!(std::fs::read(&victim).expect("victim"), b"precious");
        assert_eq!(
            std::fs::read(dir.path().join("b.db-retinue-writers")).expect("foreign"),
            b"not a counter of ours"
        );
    }

    #[test]
    fn no_file_for_an_in_memory_database() {
        assert!(ProcessQueue::open(Path::new(":memory:")).is_none());
    }
}
