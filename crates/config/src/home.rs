//! Where the hermes home is: `HERMES_HOME`, else `<user home>/.hermes`.

use std::path::PathBuf;

/// Resolves `HERMES_HOME`: the trimmed env var, else `<user home>/.hermes`
/// (see [`user_home`]). When no home can be determined at all, `/.hermes`
/// (never the current directory); [`try_hermes_home`] reports that case.
pub fn hermes_home() -> PathBuf {
    try_hermes_home().unwrap_or_else(|| PathBuf::from("/.hermes"))
}

/// `HERMES_HOME` (trimmed), else `<user home>/.hermes`; `None` when neither
/// the variable nor a user home exists.
pub fn try_hermes_home() -> Option<PathBuf> {
    let env = std::env::var("HERMES_HOME").unwrap_or_default();
    let trimmed = env.trim();
    if !trimmed.is_empty() {
        return Some(PathBuf::from(trimmed));
    }
    user_home().map(|h| h.join(".hermes"))
}

/// The user's home as Python's `Path.home()` finds it (what hermes uses):
/// `$HOME` when set (trailing `/` removed; an empty value is `/`), else the
/// home field of the passwd entry of the real uid. Never the current directory.
pub fn user_home() -> Option<PathBuf> {
    if let Some(home) = std::env::var_os("HOME") {
        let text = home.to_string_lossy();
        let stripped = text.trim_end_matches('/');
        return Some(PathBuf::from(if stripped.is_empty() { "/" } else { stripped }));
    }
    let uid = real_uid()?;
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd_home(&passwd, uid).map(PathBuf::from)
}

/// The real uid from `/proc/self/status` (`Uid:` real, effective, …).
fn real_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|u| u.parse().ok())
}

/// The home field of the first passwd line for `uid` (`name:pw:uid:gid:gecos:home:shell`).
pub(crate) fn passwd_home(passwd: &str, uid: u32) -> Option<String> {
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.len() >= 7 && fields[2].parse::<u32>().ok() == Some(uid) && !fields[5].is_empty())
            .then(|| fields[5].to_owned())
    })
}

#[cfg(test)]
mod home_tests {
    #[test]
    fn passwd_home_picks_the_uid_line() {
        let passwd =
            "root:x:0:0:root:/root:/bin/sh\n# c\nbad\nann:x:1000:1000::/home/ann:/bin/sh\n";
        assert_eq!(super::passwd_home(passwd, 1000).as_deref(), Some("/home/ann"));
        assert_eq!(super::passwd_home(passwd, 0).as_deref(), Some("/root"));
        assert_eq!(super::passwd_home(passwd, 7), None);
    }
}
