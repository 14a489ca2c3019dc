//! Aligned plain-text tables and key/value blocks for the human output.
//!
//! Goals and ids are written by language models: every cell and value is
//! passed through [`escape`], so no terminal control character (C0, C1, DEL,
//! an ESC sequence) reaches the terminal, and columns align by display width
//! (CJK and emoji take two columns).

use std::fmt::Write as _;

use unicode_width::UnicodeWidthStr;

/// A table: a header row and data rows, columns padded to their widest cell.
#[derive(Debug, Default)]
pub(crate) struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

/// The display width of `s` in terminal columns.
pub(crate) fn width(s: &str) -> usize {
    UnicodeWidthStr::width(s)
}

/// `s` with control characters made visible: `\n`, `\t`, `\r`, `\e` for
/// ESC, `\u{…}` for any other C0, C1 or DEL character.
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '\u{1b}' => out.push_str("\\e"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out
}

impl Table {
    /// A table with these column headers.
    pub(crate) fn new(headers: &[&str]) -> Table {
        Table { headers: headers.iter().map(|h| (*h).to_owned()).collect(), rows: Vec::new() }
    }

    /// Adds one row (missing cells are blank, extra cells dropped); control
    /// characters in a cell are escaped.
    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells.iter().map(|c| escape(c)).collect());
    }

    /// Whether no row was added.
    pub(crate) fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rendered table, one line per row, ending with a newline.
    pub(crate) fn render(&self) -> String {
        let n = self.headers.len();
        let cell = |row: &Vec<String>, i: usize| row.get(i).cloned().unwrap_or_default();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| width(h)).collect();
        for row in &self.rows {
            for (i, w) in widths.iter_mut().enumerate() {
                *w = (*w).max(width(&cell(row, i)));
            }
        }
        let mut out = String::new();
        for row in std::iter::once(&self.headers).chain(&self.rows) {
            let mut line = String::new();
            for (i, w) in widths.iter().enumerate() {
                let text = cell(row, i);
                line.push_str(&text);
                if i + 1 < n {
                    line.push_str(&" ".repeat(w - width(&text) + 2));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `key  value` lines with the keys padded to the longest one; control
/// characters in a value are escaped.
pub(crate) fn key_values(pairs: &[(&str, String)]) -> String {
    let w = pairs.iter().map(|(k, _)| width(k)).max().unwrap_or(0);
    pairs
        .iter()
        .map(|(k, v)| {
            format!("{k}{}  {}", " ".repeat(w - width(k)), escape(v)).trim_end().to_owned() + "\n"
        })
        .collect()
}

/// Cuts `s` (on one line, controls escaped) to `max` display columns,
/// marking the cut with `…`.
pub(crate) fn clip(s: &str, max: usize) -> String {
    let one_line = escape(&s.split_whitespace().collect::<Vec<_>>().join(" "));
    if width(&one_line) <= max {
        return one_line;
    }
    let mut kept = String::new();
    for c in one_line.chars() {
        let mut next = kept.clone();
        next.push(c);
        if width(&next) > max.saturating_sub(1) {
            break;
        }
        kept = next;
    }
    format!("{kept}…")
}

/// Wraps each line of `text` at `max` characters on spaces, keeping a line's
/// leading indent on its continuation lines. Words longer than `max` stay whole.
pub(crate) fn wrap(text: &str, max: usize) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let indent: String = line.chars().take_while(|c| *c == ' ').collect();
        let mut current = indent.clone();
        for word in line.split_whitespace() {
            let fresh = current.len() == indent.len();
            if !fresh && width(&current) + 1 + width(word) > max {
                out.push_str(&current);
                out.push('\n');
                current.clone_from(&indent);
            }
            if current.len() > indent.len() {
                current.push(' ');
            }
            current.push_str(word);
        }
        out.push_str(current.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_and_lines_have_no_trailing_spaces() {
        let mut t = Table::new(&["A", "LONGER", "C"]);
        t.row(vec!["xyz".into(), "1".into(), String::new()]);
        t.row(vec!["é".into(), "22".into(), "last".into()]);
        assert_eq!(t.render(), "A    LONGER  C\nxyz  1\né    22      last\n");
    }

    #[test]
    fn key_values_and_clip() {
        assert_eq!(key_values(&[("a", "1".into()), ("bbb", "2".into())]), "a    1\nbbb  2\n");
        assert_eq!(clip("hello   world", 20), "hello world");
        assert_eq!(clip("abcdef", 4), "abc…");
    }

    #[test]
    fn controls_are_escaped_and_wide_characters_align() {
        let mut t = Table::new(&["ID", "GOAL"]);
        t.row(vec!["\u{1b}[31mred".into(), "a\u{7}b\u{9b}c\u{7f}".into()]);
        t.row(vec!["日本語".into(), "x".into()]);
        assert_eq!(
            t.render(),
            "ID         GOAL\n\\e[31mred  a\\u{7}b\\u{9b}c\\u{7f}\n日本語     x\n"
        );
        assert_eq!(key_values(&[("k", "line1\nline2".into())]), "k  line1\\nline2\n");
        assert_eq!(clip("日本語テキスト", 7), "日本語…");
        assert_eq!(width("🙂"), 2);
    }

    #[test]
    fn wrap_keeps_indent() {
        assert_eq!(wrap("aa bb cc", 5), "aa bb\ncc\n");
        assert_eq!(wrap("  aa bb cc\n\nx", 7), "  aa bb\n  cc\n\nx\n");
    }
}
