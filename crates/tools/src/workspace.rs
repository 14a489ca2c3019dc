//! [`Workspace`]: a directory every file tool works beneath.
//!
//! Paths from the model are untrusted. Each is checked lexically (no NUL,
//! no `~`, an absolute path only when it lies under the root, no `..` above
//! the root), then opened with `openat2(2)` relative to the root's
//! descriptor with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//! RESOLVE_NO_MAGICLINKS`: the kernel refuses any escape and any symlink on
//! the way at the moment of the open, so there is no check-then-open race.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use retinue_core::run::ToolError;

/// A child's workspace: its root directory, held open, and what of it a
/// child may never reach or write ([`Protected`]). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Workspace {
    root: PathBuf,
    fd: std::sync::Arc<OwnedFd>,
    guard: std::sync::Arc<Guard>,
}

/// Names that make code run later, outside the sandbox (git hooks and
/// `core.hooksPath`/`core.fsmonitor`, direnv, editors' tasks, agents'
/// configuration): read-only for children wherever they appear in a path.
pub const READ_ONLY_NAMES: &[&str] = &[".git", ".envrc", ".vscode", ".idea", ".hermes", ".retinue"];

/// Directories that are never a workspace: the file system's root, the
/// system's directories and the places users' homes live (the user's own
/// home is refused too, see [`refusal`]).
pub const REFUSED_ROOTS: &[&str] = &[
    "/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/opt",
    "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var",
];

/// What a child may never reach: the home (the directory of `state.db` and
/// `config.yaml`) and the database file, by absolute path. Those inside a
/// workspace are hidden from the file tools and from the sandbox.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Protected {
    /// Absolute paths hidden from children.
    pub hidden: Vec<PathBuf>,
}

/// The protection of one open workspace, relative to its root.
#[derive(Debug, Default)]
struct Guard {
    /// Hidden paths inside the root (relative, normalised), with the
    /// identity each had when the workspace was opened (if it existed).
    hidden: Vec<(PathBuf, Option<(u64, u64)>)>,
    /// The hidden files' identities (a hard link to one is hidden too).
    hidden_ids: Vec<(u64, u64)>,
}

/// Whether `path` starts with `prefix`, component by component, ignoring
/// ASCII case (a case-insensitive file system would open either).
fn starts_with_ci(path: &Path, prefix: &Path) -> bool {
    let mut p = path.components();
    for want in prefix.components() {
        match p.next() {
            Some(got) if got.as_os_str().eq_ignore_ascii_case(want.as_os_str()) => {}
            _ => return false,
        }
    }
    true
}

/// Directories nothing beneath which is a workspace (the system's own;
/// `/usr/src`, `/usr/local/src` and the like stay possible).
pub const REFUSED_TREES: &[&str] = &[
    "/etc",
    "/boot",
    "/proc",
    "/sys",
    "/dev",
    "/usr/bin",
    "/usr/sbin",
    "/usr/lib",
    "/usr/lib32",
    "/usr/lib64",
    "/usr/libexec",
    "/usr/include",
    "/usr/share",
    "/usr/local/bin",
    "/usr/local/sbin",
    "/usr/local/lib",
    "/usr/local/share",
];

/// Why `root` cannot be a workspace, if it cannot: it is `/`, a system
/// directory ([`REFUSED_ROOTS`], compared canonically: `/bin` is `/usr/bin`
/// on a merged-usr system), lies beneath one of [`REFUSED_TREES`], or is
/// the user's home directory or one of its ancestors.
pub fn refusal(root: &Path) -> Option<String> {
    let canonical = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    let homes = [std::env::var_os("HOME").map(PathBuf::from), user_home()];
    if homes
        .iter()
        .flatten()
        .filter(|h| h.is_absolute())
        .filter_map(|h| std::fs::canonicalize(h).ok())
        .any(|h| h.starts_with(&canonical) && canonical != Path::new("/"))
    {
        return Some(format!(
            "{} is refused as a workspace: it is the user's home directory or holds it (its \
             keys, sockets and dotfiles); use a project directory",
            canonical.display()
        ));
    }
    let canon = |p: &str| std::fs::canonicalize(p).unwrap_or_else(|_| PathBuf::from(p));
    let system = REFUSED_ROOTS.iter().any(|r| canonical == canon(r))
        || REFUSED_TREES
            .iter()
            .any(|t| canonical.starts_with(canon(t)) || canonical.starts_with(t));
    if system {
        return Some(format!(
            "{} is refused as a workspace: children may work in a project directory, never in \
             `/` or a system directory",
            canonical.display()
        ));
    }
    None
}

/// The current user's home directory from the password database.
fn user_home() -> Option<PathBuf> {
    nix::unistd::User::from_uid(nix::unistd::getuid()).ok().flatten().map(|u| u.dir)
}

/// `path` made absolute and canonical as far as it exists (a file that is
/// not there yet keeps its name under its canonical parent).
fn canonical_lenient(path: &Path) -> Option<PathBuf> {
    if let Ok(p) = std::fs::canonicalize(path) {
        return Some(p);
    }
    let parent = canonical_lenient(path.parent()?)?;
    Some(parent.join(path.file_name()?))
}

const BENEATH: ResolveFlags =
    ResolveFlags::BENEATH.union(ResolveFlags::NO_SYMLINKS).union(ResolveFlags::NO_MAGICLINKS);

/// A path inside the workspace, relative to its root and normalised (no
/// `.`/`..`, never empty: the root itself is `.`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inside(PathBuf);

impl Inside {
    /// The relative path (`.` for the root).
    pub fn rel(&self) -> &Path {
        &self.0
    }

    /// The path as shown to the model (relative, `/`-separated; bytes that
    /// are not UTF-8 as `\xNN`, which [`Workspace::inside`] accepts back).
    pub fn shown(&self) -> String {
        escaped(self.0.as_os_str())
    }
}

/// A name as shown to the model: UTF-8 as it is, every other byte as
/// `\xNN` (so the name can be given back to a file tool).
pub fn escaped(name: &std::ffi::OsStr) -> String {
    let mut out = String::new();
    for chunk in name.as_encoded_bytes().utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// The bytes `\xNN` escapes stand for (`None`: no escape in `path`).
fn unescaped(path: &str) -> Option<std::ffi::OsString> {
    use std::os::unix::ffi::OsStringExt;
    if !path.contains("\\x") {
        return None;
    }
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && bytes.get(i + 1) == Some(&b'x')
            && let Some(hex) = path.get(i + 2..i + 4)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Some(std::ffi::OsString::from_vec(out))
}

impl Workspace {
    /// Opens `root` (it must be an existing directory) with nothing
    /// hidden but the read-only names ([`READ_ONLY_NAMES`]).
    pub fn open(root: &Path) -> Result<Workspace, ToolError> {
        Workspace::open_protected(root, &Protected::default())
    }

    /// Opens `root` with `protected` hidden beneath it. A root that
    /// [`refusal`] names is refused.
    pub fn open_protected(root: &Path, protected: &Protected) -> Result<Workspace, ToolError> {
        let real = std::fs::canonicalize(root).map_err(|e| {
            ToolError::Refused(format!("the workspace {} cannot be opened: {e}", root.display()))
        })?;
        let fd = rustix::fs::open(
            &real,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            ToolError::Refused(format!("the workspace {} cannot be opened: {e}", real.display()))
        })?;
        if let Some(why) = refusal(&real) {
            return Err(ToolError::Refused(why));
        }
        let mut guard = Guard::default();
        for p in &protected.hidden {
            let Some(abs) = canonical_lenient(p) else { continue };
            let st = rustix::fs::stat(&abs).ok();
            let id = st.as_ref().map(|st| (st.st_dev, st.st_ino));
            // Only a directory's place is checked on every call (a rename
            // of a directory above it would uncover it); a file may be
            // replaced by an ordinary save or upgrade.
            let is_dir =
                st.is_some_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory);
            if let Ok(rel) = abs.strip_prefix(&real) {
                if rel.as_os_str().is_empty() {
                    return Err(ToolError::Refused(format!(
                        "the workspace {} is Retinue's own home or holds its database: use a \
                         project directory",
                        real.display()
                    )));
                }
                guard.hidden.push((rel.to_path_buf(), id.filter(|_| is_dir)));
            }
            guard.hidden_ids.extend(id);
        }
        Ok(Workspace { root: real, fd: std::sync::Arc::new(fd), guard: std::sync::Arc::new(guard) })
    }

    /// The hidden paths inside the root, absolute (the sandbox covers them).
    pub fn hidden(&self) -> Vec<PathBuf> {
        self.guard.hidden.iter().map(|(r, _)| self.root.join(r)).collect()
    }

    /// Refuses when a hidden path is no longer where it was when the
    /// workspace was opened (a child renamed a directory above it): its
    /// files could no longer be kept from the child.
    pub fn hidden_intact(&self) -> Result<(), ToolError> {
        for (rel, id) in &self.guard.hidden {
            let Some(id) = id else { continue };
            let now =
                rustix::fs::statat(self.fd.as_fd(), rel, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
                    .ok()
                    .map(|st| (st.st_dev, st.st_ino));
            if now != Some(*id) {
                return Err(ToolError::Refused(format!(
                    "Retinue's home or database was moved or replaced inside the workspace (at \
                     `{}`); the tools are refused here until the workspace is opened again",
                    rel.display()
                )));
            }
        }
        Ok(())
    }

    /// The read-only names present at the root, absolute (the sandbox
    /// binds them read-only).
    pub fn read_only_present(&self) -> Vec<PathBuf> {
        READ_ONLY_NAMES
            .iter()
            .filter(|n| {
                rustix::fs::statat(self.fd.as_fd(), **n, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok()
            })
            .map(|n| self.root.join(n))
            .collect()
    }

    /// Whether `rel` (relative to the root) is hidden or beneath a hidden path.
    pub fn is_hidden(&self, rel: &Path) -> bool {
        self.guard.hidden.iter().any(|(h, _)| starts_with_ci(rel, h))
    }

    /// Refuses `p` when it is hidden (the home, the database).
    pub fn guard_read(&self, p: &Inside) -> Result<(), ToolError> {
        self.hidden_intact()?;
        if self.is_hidden(p.rel()) {
            return Err(ToolError::Refused(format!(
                "path `{}` refused: it is Retinue's home or database, which children never reach",
                p.shown()
            )));
        }
        Ok(())
    }

    /// Refuses `p` when it is hidden or read-only (a part of it is one of
    /// [`READ_ONLY_NAMES`]).
    pub fn guard_write(&self, p: &Inside) -> Result<(), ToolError> {
        self.guard_read(p)?;
        if let Some(name) = p
            .rel()
            .components()
            .filter_map(|c| c.as_os_str().to_str())
            .find(|c| READ_ONLY_NAMES.iter().any(|n| n.eq_ignore_ascii_case(c)))
        {
            return Err(ToolError::Refused(format!(
                "path `{}` refused: `{name}` is read-only for children (files there make code \
                 run later outside the sandbox: git hooks and config, direnv, editor tasks, \
                 agent settings)",
                p.shown()
            )));
        }
        Ok(())
    }

    /// The root's canonical path.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether the root path still names the directory held open (it was
    /// not replaced or removed since).
    pub fn is_current(&self) -> bool {
        let (Ok(held), Ok(now)) = (rustix::fs::fstat(&*self.fd), rustix::fs::stat(&self.root))
        else {
            return false;
        };
        (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)
    }

    /// Checks `path` (as the model gave it) and makes it relative to the root.
    pub fn inside(&self, path: &str) -> Result<Inside, ToolError> {
        let refuse =
            |why: &str| ToolError::Refused(format!("path `{}` refused: {why}", shown(path)));
        if path.contains('\0') {
            return Err(refuse("it contains a NUL byte"));
        }
        let trimmed = path.trim();
        if trimmed.starts_with('~') {
            return Err(refuse("`~` paths are outside the workspace"));
        }
        let literal = self.lexical(std::ffi::OsStr::new(trimmed), &refuse)?;
        // A name shown escaped (not UTF-8) is taken back when the literal
        // name does not exist.
        if let Some(raw) = unescaped(trimmed)
            && rustix::fs::statat(
                self.fd.as_fd(),
                literal.rel(),
                rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
            )
            .is_err()
        {
            return self.lexical(&raw, &refuse);
        }
        Ok(literal)
    }

    /// The lexical part of [`Workspace::inside`].
    fn lexical(
        &self,
        given: &std::ffi::OsStr,
        refuse: &dyn Fn(&str) -> ToolError,
    ) -> Result<Inside, ToolError> {
        let given = Path::new(if given.is_empty() { std::ffi::OsStr::new(".") } else { given });
        let relative: &Path = if given.is_absolute() {
            given.strip_prefix(&self.root).map_err(|_| {
                refuse(&format!("it is outside the workspace {}", self.root.display()))
            })?
        } else {
            given
        };
        let mut parts: Vec<&std::ffi::OsStr> = Vec::new();
        for c in relative.components() {
            match c {
                Component::CurDir => {}
                Component::ParentDir => {
                    if parts.pop().is_none() {
                        return Err(refuse("it leads out of the workspace"));
                    }
                }
                Component::Normal(p) => parts.push(p),
                Component::RootDir | Component::Prefix(_) => {
                    return Err(refuse("it is outside the workspace"));
                }
            }
        }
        let rel: PathBuf =
            if parts.is_empty() { PathBuf::from(".") } else { parts.iter().collect() };
        Ok(Inside(rel))
    }

    fn open_at(&self, p: &Inside, flags: OFlags, mode: Mode) -> Result<OwnedFd, ToolError> {
        rustix::fs::openat2(self.fd.as_fd(), p.rel(), flags | OFlags::CLOEXEC, mode, BENEATH)
            .map_err(|e| open_error(p, e))
    }

    /// Opens a regular file for reading (FIFOs, devices and directories are
    /// refused without blocking), with its size.
    pub fn open_file(&self, p: &Inside) -> Result<(File, u64), ToolError> {
        self.guard_read(p)?;
        let fd =
            self.open_at(p, OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOFOLLOW, Mode::empty())?;
        let stat = rustix::fs::fstat(&fd).map_err(|e| open_error(p, e))?;
        if self.guard.hidden_ids.contains(&(stat.st_dev, stat.st_ino)) {
            return Err(ToolError::Refused(format!(
                "path `{}` refused: it is Retinue's home or database, which children never reach",
                p.shown()
            )));
        }
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::RegularFile => {}
            FileType::Directory => {
                return Err(ToolError::Failed(format!(
                    "`{}` is a directory; use search_files with target `files` to list it",
                    p.shown()
                )));
            }
            other => {
                return Err(ToolError::Refused(format!(
                    "`{}` is not a regular file ({other:?}); only regular files are read",
                    p.shown()
                )));
            }
        }
        // Back to blocking reads for a regular file.
        rustix::fs::fcntl_setfl(&fd, OFlags::empty()).map_err(|e| open_error(p, e))?;
        Ok((File::from(fd), u64::try_from(stat.st_size).unwrap_or(0)))
    }

    /// Checks that `p` exists beneath the root with no symlink on the way
    /// (itself included).
    pub fn check(&self, p: &Inside) -> Result<(), ToolError> {
        self.guard_read(p)?;
        self.open_at(p, OFlags::PATH, Mode::empty()).map(drop)
    }

    /// Opens a directory beneath the root.
    fn open_dir(&self, p: &Inside) -> Result<OwnedFd, ToolError> {
        self.open_at(p, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())
    }

    /// Opens the parent directory of `p`, creating missing directories;
    /// returns it, the file name, and whether any directory was created.
    fn parent_dir<'p>(
        &self,
        p: &'p Inside,
    ) -> Result<(OwnedFd, &'p std::ffi::OsStr, bool), ToolError> {
        let name = p
            .rel()
            .file_name()
            .ok_or_else(|| ToolError::InvalidArguments(format!("`{}` names no file", p.shown())))?;
        let mut created = false;
        let mut dir = self.open_dir(&Inside(PathBuf::from(".")))?;
        let open = |dir: &OwnedFd, comp: &std::ffi::OsStr| {
            rustix::fs::openat2(
                dir.as_fd(),
                comp,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
                BENEATH,
            )
        };
        if let Some(parent) = p.rel().parent() {
            let mut sofar = PathBuf::new();
            for comp in parent.components() {
                sofar.push(comp);
                let comp = comp.as_os_str();
                dir = match open(&dir, comp) {
                    Ok(fd) => fd,
                    Err(Errno::NOENT) => {
                        match rustix::fs::mkdirat(dir.as_fd(), comp, Mode::from_raw_mode(0o755)) {
                            Ok(()) | Err(Errno::EXIST) => {}
                            Err(e) => return Err(open_error(&Inside(sofar), e)),
                        }
                        created = true;
                        open(&dir, comp).map_err(|e| open_error(&Inside(sofar.clone()), e))?
                    }
                    Err(e) => return Err(open_error(&Inside(sofar), e)),
                };
            }
        }
        Ok((dir, name, created))
    }

    /// Replaces (or creates) the regular file `p` with `bytes`, atomically:
    /// written to a temporary file beside it, then renamed over it, so a
    /// failed write never leaves it half-written. Parent directories are
    /// created; an existing file keeps its permissions. Returns whether any
    /// directory was created.
    pub fn replace_file(&self, p: &Inside, bytes: &[u8]) -> Result<bool, ToolError> {
        use std::io::Write;
        self.guard_write(p)?;
        let (dir, name, created) = self.parent_dir(p)?;
        let mut mode = Mode::from_raw_mode(0o644);
        match rustix::fs::statat(dir.as_fd(), name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => match FileType::from_raw_mode(st.st_mode) {
                FileType::RegularFile => mode = Mode::from_raw_mode(st.st_mode & 0o777),
                FileType::Symlink => {
                    return Err(open_error(p, Errno::LOOP));
                }
                _ => {
                    return Err(ToolError::Refused(format!(
                        "`{}` is not a regular file; only regular files are written",
                        p.shown()
                    )));
                }
            },
            Err(Errno::NOENT) => {}
            Err(e) => return Err(open_error(p, e)),
        }
        let mut suffix = [0u8; 6];
        rustix::rand::getrandom(&mut suffix, rustix::rand::GetRandomFlags::empty())
            .map_err(|e| open_error(p, e))?;
        let tmp_name = format!(
            ".{}.retinue-{}.tmp",
            name.to_string_lossy(),
            suffix.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        let fd = rustix::fs::openat2(
            dir.as_fd(),
            tmp_name.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            mode,
            BENEATH,
        )
        .map_err(|e| open_error(p, e))?;
        let mut file = File::from(fd);
        let written = file.write_all(bytes).and_then(|()| file.sync_data());
        let renamed = written
            .map_err(|e| ToolError::Failed(format!("`{}`: {e}", p.shown())))
            .and_then(|()| {
                rustix::fs::renameat(dir.as_fd(), tmp_name.as_str(), dir.as_fd(), name)
                    .map_err(|e| open_error(p, e))
            });
        if renamed.is_err() {
            let _ =
                rustix::fs::unlinkat(dir.as_fd(), tmp_name.as_str(), rustix::fs::AtFlags::empty());
        }
        renamed.map(|()| created)
    }
}

/// A path as shown in an error (bounded; control characters escaped).
fn shown(path: &str) -> String {
    let cut: String = path.chars().take(200).collect();
    let cut = cut.escape_debug().to_string();
    if path.chars().count() > 200 { format!("{cut}…") } else { cut }
}

fn open_error(p: &Inside, e: Errno) -> ToolError {
    let path = p.shown();
    match e {
        Errno::NOENT => ToolError::Failed(format!("`{path}` not found in the workspace")),
        Errno::XDEV => {
            ToolError::Refused(format!("path `{path}` refused: it leads out of the workspace"))
        }
        Errno::LOOP => ToolError::Refused(format!(
            "path `{path}` refused: it goes through a symbolic link (links are not followed in the \
             workspace)"
        )),
        Errno::NOTDIR => {
            ToolError::Failed(format!("`{path}`: a part of the path is not a directory"))
        }
        Errno::ISDIR => ToolError::Failed(format!("`{path}` is a directory")),
        Errno::ACCESS | Errno::PERM => ToolError::Failed(format!("`{path}`: permission denied")),
        Errno::ROFS => ToolError::Failed(format!(
            "`{path}`: the workspace is on a read-only file system; nothing was written"
        )),
        Errno::NOSYS => ToolError::Refused(
            "this kernel lacks openat2 (Linux 5.6+), which the file tools need to stay inside the \
             workspace"
                .to_owned(),
        ),
        other => ToolError::Failed(format!("`{path}`: {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexical_checks() {
        let dir = tempfile::tempdir().expect("tmp");
        let ws = Workspace::open(dir.path()).expect("open");
        assert_eq!(ws.inside("a/./b/../c").expect("ok").rel(), Path::new("a/c"));
        assert_eq!(ws.inside("").expect("ok").rel(), Path::new("."));
        let abs = ws.root().join("x/y");
        assert_eq!(ws.inside(abs.to_str().expect("utf8")).expect("ok").rel(), Path::new("x/y"));
        for bad in ["../x", "a/../../x", "/etc/passwd", "~/x", "a\0b", "/proc/self/root/etc"] {
            assert!(matches!(ws.inside(bad), Err(ToolError::Refused(_))), "{bad}");
        }
    }
}
