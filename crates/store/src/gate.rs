//! How writers of `state.db` take turns (issue #41).
//!
//! SQLite has one write lock per file and no queue: a writer that finds it
//! taken calls its busy handler, and SQLite's default handler sleeps 1, 2,
//! 5, … up to 100 ms between probes. Whoever probes at the right moment
//! wins, so one writer can lose hundreds of turns in a row while the lock
//! sits idle between a release and the next probe: the p99 was 230–2,600×
//! the p50 (docs/benchmarks.md).
//!
//! Two mechanisms replace it:
//!
//! - **Within one process**, writers never meet in the busy handler: every
//!   write transaction first takes the file's [`WriterGate`], a FIFO queue
//!   shared by every pool of the process on that file (keyed by the
//!   canonical path). Writers leave it in the order they came; readers never
//!   touch it. A writer that panics releases its turn while unwinding; a
//!   killed process takes its gate (memory) and its SQLite lock (an OS file
//!   lock) with it, so nothing is ever left locked.
//! - **Between processes** (hermes, several `retinue` processes, the
//!   workers of one home), the one writer per process that holds its gate
//!   probes the SQLite lock with [`busy_handler`]: short waits that grow
//!   from 50 µs to a cap of 1 ms, so the lock is idle for at most about a
//!   millisecond after a release, until the busy timeout; then the write
//!   fails as `Busy`, naming the time waited. Writers of other programs keep
//!   their own handlers (hermes: SQLite's default with a 1 s timeout, plus
//!   its jittered retries); the measurements in docs/benchmarks.md show they
//!   still get their turns.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

/// The first wait of the busy handler.
const FIRST_WAIT: Duration = Duration::from_micros(50);
/// The longest single wait of the busy handler: the lock is idle for at
/// most about this long after its holder releases it.
const MAX_WAIT: Duration = Duration::from_millis(1);

/// The wait before probe `count` (0-based) of one busy episode: 50 µs,
/// doubling, capped at [`MAX_WAIT`].
pub(crate) fn busy_wait(count: i32) -> Duration {
    let shift = u32::try_from(count.clamp(0, 16)).unwrap_or(0);
    FIRST_WAIT.saturating_mul(1u32 << shift).min(MAX_WAIT)
}

/// A busy handler for one connection: probes again after [`busy_wait`]
/// until `timeout` has passed since the episode's first call (SQLite
/// passes 0 on the first call of each locking event); every call counts
/// in `probes`.
pub(crate) fn busy_handler(
    timeout: Duration,
    probes: Arc<AtomicU64>,
) -> impl FnMut(i32) -> bool + Send + 'static {
    let mut started = Instant::now();
    move |count| {
        probes.fetch_add(1, Ordering::Relaxed);
        if count == 0 {
            started = Instant::now();
        }
        let left = timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            return false;
        }
        std::thread::sleep(busy_wait(count).min(left));
        true
    }
}

/// How many writes of one process may follow each other in one turn
/// between processes while more of its writers queue: fewer hand-offs
/// between processes (each costs two wake-ups), and still every process
/// writes within a bounded number of others' turns.
const WRITES_PER_TURN: u32 = 8;

/// The FIFO queue of one database file's writers in this process.
#[derive(Default)]
pub(crate) struct WriterGate {
    state: Mutex<Queue>,
    /// The file's queue between processes, opened at the first write
    /// (see [`crate::queue`]); `None` where there is none.
    #[cfg(target_os = "linux")]
    between: OnceLock<Option<crate::queue::ProcessQueue>>,
    /// The database file (for its queue's file).
    path: PathBuf,
}

#[derive(Default)]
struct Queue {
    /// Writers waiting, oldest first: their ticket and their thread.
    waiting: VecDeque<(u64, std::thread::Thread)>,
    /// The ticket holding the gate. A release hands the gate to the
    /// oldest waiter directly (and wakes only that one), so no late
    /// arrival can take it in between.
    holder: Option<u64>,
    next_ticket: u64,
    /// The turn between processes this process holds (its ticket there),
    /// and the writes done in it.
    between: Option<(u64, u32)>,
}

/// The gate's turn, released on drop (also while unwinding).
pub(crate) struct GateTurn<'a> {
    /// `None`: this thread already held the gate (a nested write), so this
    /// turn releases nothing.
    gate: Option<&'a WriterGate>,
}

thread_local! {
    /// The gates this thread holds (their addresses): a nested write on the
    /// same file passes instead of waiting for itself.
    static HELD: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn address(gate: &WriterGate) -> usize {
    std::ptr::from_ref(gate) as usize
}

impl Drop for GateTurn<'_> {
    fn drop(&mut self) {
        let Some(gate) = self.gate else { return };
        HELD.with(|h| h.borrow_mut().retain(|a| *a != address(gate)));
        let mut q = gate.state.lock().unwrap_or_else(PoisonError::into_inner);
        // The turn between processes passes on with the gate while this
        // process's writers queue, up to WRITES_PER_TURN; else it is left.
        if let Some((ticket, writes)) = q.between
            && (q.waiting.is_empty() || writes >= WRITES_PER_TURN)
        {
            q.between = None;
            gate.leave_between(ticket);
        }
        match q.waiting.pop_front() {
            Some((ticket, thread)) => {
                q.holder = Some(ticket);
                drop(q);
                thread.unpark();
            }
            None => q.holder = None,
        }
    }
}

/// The gate could not be taken within the busy timeout.
#[derive(Debug, thiserror::Error)]
#[error(
    "{} still queued for the database after {waited_ms} ms",
    if *between_processes { "another process's writer was" } else { "earlier writers of this process were" }
)]
pub(crate) struct GateTimeout {
    /// Writers still ahead when the wait gave up.
    pub(crate) ahead: usize,
    /// How long the writer queued.
    pub(crate) waited_ms: u64,
    /// Whether it queued behind another process's writer (else: behind
    /// this process's own).
    pub(crate) between_processes: bool,
}

impl WriterGate {
    /// Waits for this writer's turn in this process and then between
    /// processes, at most `timeout` in all.
    pub(crate) fn enter(&self, timeout: Duration) -> Result<GateTurn<'_>, GateTimeout> {
        let started = Instant::now();
        let turn = self.enter_here(timeout)?;
        if turn.gate.is_some() {
            let left = timeout.saturating_sub(started.elapsed());
            if let Err(mut e) = self.enter_between(left) {
                e.waited_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                // Dropping `turn` hands the gate on.
                return Err(e);
            }
        }
        Ok(turn)
    }

    /// Takes this process's turn between processes, unless it holds it
    /// already (passed on by the previous writer). The caller holds the gate.
    #[cfg(target_os = "linux")]
    fn enter_between(&self, timeout: Duration) -> Result<(), GateTimeout> {
        {
            let mut q = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some((_, writes)) = q.between.as_mut() {
                *writes += 1;
                return Ok(());
            }
        }
        let queue = self.between.get_or_init(|| crate::queue::ProcessQueue::open(&self.path));
        let Some(queue) = queue else { return Ok(()) };
        // Outside the state lock: waiters queue meanwhile.
        let entered = queue.enter(timeout).map_err(|waited_ms| GateTimeout {
            ahead: 1,
            waited_ms,
            between_processes: true,
        })?;
        if let Some(ticket) = entered {
            self.state.lock().unwrap_or_else(PoisonError::into_inner).between = Some((ticket, 1));
        }
        Ok(())
    }

    #[cfg(not(target_os = "linux"))]
    fn enter_between(&self, _timeout: Duration) -> Result<(), GateTimeout> {
        Ok(())
    }

    #[cfg(target_os = "linux")]
    fn leave_between(&self, ticket: u64) {
        if let Some(Some(queue)) = self.between.get() {
            queue.leave(ticket);
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn leave_between(&self, _ticket: u64) {}

    /// Waits for this writer's turn among this process's, at most `timeout`.
    fn enter_here(&self, timeout: Duration) -> Result<GateTurn<'_>, GateTimeout> {
        if HELD.with(|h| h.borrow().contains(&address(self))) {
            return Ok(GateTurn { gate: None });
        }
        let started = Instant::now();
        let mut q = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let ticket = q.next_ticket;
        q.next_ticket = q.next_ticket.wrapping_add(1);
        if q.holder.is_none() && q.waiting.is_empty() {
            q.holder = Some(ticket);
            return Ok(self.taken());
        }
        q.waiting.push_back((ticket, std::thread::current()));
        loop {
            if q.holder == Some(ticket) {
                return Ok(self.taken());
            }
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                let ahead = q.waiting.iter().position(|(t, _)| *t == ticket).unwrap_or(0) + 1;
                q.waiting.retain(|(t, _)| *t != ticket);
                let waited_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                return Err(GateTimeout { ahead, waited_ms, between_processes: false });
            }
            drop(q);
            std::thread::park_timeout(left);
            q = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn taken(&self) -> GateTurn<'_> {
        HELD.with(|h| h.borrow_mut().push(address(self)));
        GateTurn { gate: Some(self) }
    }

    /// Writers queued behind the holder (for tests).
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).waiting.len()
    }
}

/// The process's gates, one per database file (weakly held: a file no
/// pool has open any more has none).
fn gates() -> &'static Mutex<HashMap<PathBuf, Weak<WriterGate>>> {
    static GATES: OnceLock<Mutex<HashMap<PathBuf, Weak<WriterGate>>>> = OnceLock::new();
    GATES.get_or_init(Mutex::default)
}

/// The gate of the file at `path`, shared with every other pool of this
/// process on the same file (by canonical path; a path that cannot be
/// resolved is its own key).
pub(crate) fn gate_for(path: &Path) -> Arc<WriterGate> {
    let key = std::fs::canonicalize(path)
        .or_else(|_| {
            // Not created yet: its directory's real path and its name.
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
            std::fs::canonicalize(dir).map(|d| d.join(path.file_name().unwrap_or_default()))
        })
        .unwrap_or_else(|_| path.to_path_buf());
    let mut map = gates().lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(gate) = map.get(&key).and_then(Weak::upgrade) {
        return gate;
    }
    map.retain(|_, g| g.strong_count() > 0);
    let gate = Arc::new(WriterGate { path: key.clone(), ..WriterGate::default() });
    map.insert(key, Arc::downgrade(&gate));
    gate
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn waits_grow_from_50us_to_1ms() {
        assert_eq!(busy_wait(0), Duration::from_micros(50));
        assert_eq!(busy_wait(1), Duration::from_micros(100));
        assert_eq!(busy_wait(4), Duration::from_micros(800));
        assert_eq!(busy_wait(5), MAX_WAIT);
        assert_eq!(busy_wait(1_000), MAX_WAIT);
        assert_eq!(busy_wait(-3), FIRST_WAIT);
    }

    #[test]
    fn the_handler_gives_up_after_the_timeout() {
        let probes = Arc::new(AtomicU64::new(0));
        let mut h = busy_handler(Duration::from_millis(30), probes.clone());
        let started = Instant::now();
        let mut count = 0;
        while h(count) {
            count += 1;
        }
        assert!(started.elapsed() >= Duration::from_millis(30));
        // Short waits: many probes, not SQLite's handful of long sleeps.
        assert!(count > 20, "{count} probes");
        assert_eq!(probes.load(Ordering::Relaxed), u64::try_from(count).expect("count") + 1);
        // A new episode starts a new clock.
        assert!(h(0));
    }

    #[test]
    fn writers_take_turns_in_arrival_order() {
        let gate = Arc::new(WriterGate::default());
        let first = gate.enter(Duration::from_secs(5)).expect("free gate");
        let order = Arc::new(Mutex::new(Vec::new()));
        let arrived = Arc::new(AtomicUsize::new(0));
        let mut handles = Vec::new();
        for i in 0..6 {
            // Queue them one after another, so arrival order is known.
            while gate.queued() < i {
                std::thread::yield_now();
            }
            let (gate, order, arrived) = (gate.clone(), order.clone(), arrived.clone());
            handles.push(std::thread::spawn(move || {
                arrived.fetch_add(1, Ordering::SeqCst);
                let _turn = gate.enter(Duration::from_secs(5)).expect("a turn");
                order.lock().expect("order").push(i);
            }));
        }
        while gate.queued() < 6 {
            std::thread::yield_now();
        }
        drop(first);
        for h in handles {
            h.join().expect("writer");
        }
        assert_eq!(*order.lock().expect("order"), vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_writer_that_gives_up_leaves_the_queue() {
        let gate = Arc::new(WriterGate::default());
        let held = gate.enter(Duration::from_secs(5)).expect("free gate");
        // Another thread: this one holds the gate, so it would pass.
        let g = gate.clone();
        let e = std::thread::spawn(move || g.enter(Duration::from_millis(20)).err())
            .join()
            .expect("writer")
            .expect("times out");
        assert_eq!(e.ahead, 1);
        assert!(e.waited_ms >= 20);
        assert_eq!(gate.queued(), 0);
        drop(held);
        // The gate is free again: the one that gave up holds nothing.
        drop(gate.enter(Duration::from_millis(20)).expect("free again"));
    }

    #[test]
    fn a_writer_that_panics_releases_its_turn() {
        let gate = Arc::new(WriterGate::default());
        let g = gate.clone();
        let r = std::thread::spawn(move || {
            let _turn = g.enter(Duration::from_secs(5)).expect("free gate");
            panic!("a writer dies holding the gate");
        })
        .join();
        assert!(r.is_err());
        drop(gate.enter(Duration::from_millis(50)).expect("the next writer proceeds"));
    }

    #[test]
    fn a_nested_write_does_not_wait_for_itself() {
        let gate = WriterGate::default();
        let outer = gate.enter(Duration::from_secs(5)).expect("free gate");
        let inner = gate.enter(Duration::from_millis(10)).expect("the holder passes");
        drop(inner);
        // The outer turn still holds the gate.
        assert!(gate.state.lock().expect("state").holder.is_some());
        drop(outer);
        assert!(gate.state.lock().expect("state").holder.is_none());
    }

    #[test]
    fn one_gate_per_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        let before = gate_for(&dir.path().join("state.db"));
        std::fs::write(&path, b"").expect("file");
        let a = gate_for(&path);
        let b = gate_for(&dir.path().join(".").join("state.db"));
        assert!(Arc::ptr_eq(&a, &before), "a file created after its first open keeps its gate");
        assert!(Arc::ptr_eq(&a, &b));
        let other = gate_for(&dir.path().join("other.db"));
        assert!(!Arc::ptr_eq(&a, &other));
    }
}
