//! A shell-like reading of a command line: POSIX quoting and escapes,
//! the operators that split it into pipelines of simple commands, output
//! redirections, comments, and command substitutions (`$(…)`, backticks,
//! `<(…)`, `>(…)`), each kept as text for the classifier to read on its own.

/// One simple command as the lexer read it.
#[derive(Debug, Default, Clone)]
pub(super) struct Cmd {
    /// Its words, quotes removed; a substitution is `\u{0}N\u{0}` (its index).
    pub(super) words: Vec<String>,
    /// Where its output redirections write.
    pub(super) redirects: Vec<String>,
}

#[derive(Debug, Default)]
pub(super) struct Parsed {
    /// Commands joined by `|` form a pipeline; `;`, `&&`, `||`, `&` and
    /// newlines end one.
    pub(super) pipelines: Vec<Vec<Cmd>>,
    /// The texts of `$(…)`, backticks, `<(…)` and `>(…)`.
    pub(super) substitutions: Vec<String>,
}

/// Reads `text` (never fails: unbalanced quotes and parentheses run to the end).
pub(super) fn lex(text: &str) -> Parsed {
    let mut lexer = Lexer { chars: text.chars().collect(), ..Lexer::default() };
    while lexer.i < lexer.chars.len() {
        lexer.step();
        lexer.i += 1;
    }
    lexer.end_word();
    lexer.end_command();
    lexer.end_pipeline();
    // `{` and `}` group commands; as words they carry no meaning here. A
    // brace list (`{rm,-rf,build}`) is the words it expands to.
    for c in lexer.out.pipelines.iter_mut().flatten() {
        c.words.retain(|w| w != "{" && w != "}");
        c.words = std::mem::take(&mut c.words)
            .into_iter()
            .flat_map(|w| match w.strip_prefix('{').and_then(|w| w.strip_suffix('}')) {
                Some(list) if list.contains(',') => list.split(',').map(str::to_owned).collect(),
                _ => vec![w],
            })
            .collect();
    }
    lexer.out
}

#[derive(Default)]
struct Lexer {
    chars: Vec<char>,
    i: usize,
    out: Parsed,
    pipeline: Vec<Cmd>,
    cmd: Cmd,
    word: String,
    in_word: bool,
    /// The next word is an output redirection's target.
    redirect_next: bool,
}

impl Lexer {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.i + 1).copied()
    }

    /// Reads the character at `i` (and whatever it opens); `i` is then at
    /// the last character read.
    fn step(&mut self) {
        let c = self.chars[self.i];
        match c {
            '\'' => self.single_quoted(),
            '"' => self.double_quoted(),
            '\\' => {
                if let Some(next) = self.peek() {
                    if next != '\n' {
                        self.word.push(next);
                        self.in_word = true;
                    }
                    self.i += 1;
                }
            }
            '$' if self.peek() == Some('\'') => {
                self.i += 1;
                self.ansi_c_quoted();
            }
            '$' | '<' | '>' if self.peek() == Some('(') => {
                let (inner, next) = balanced(&self.chars, self.i + 2);
                self.substitution(inner, next);
            }
            '`' => {
                let (inner, next) = backticked(&self.chars, self.i + 1);
                self.substitution(inner, next);
            }
            '#' if !self.in_word => {
                while self.i + 1 < self.chars.len() && self.chars[self.i + 1] != '\n' {
                    self.i += 1;
                }
            }
            '>' | '<' => self.redirection(c == '>'),
            '&' if self.peek() == Some('>') => {
                // `&>` / `&>>`: both streams to a file.
                self.end_word();
                self.i += 1;
                while self.peek() == Some('>') {
                    self.i += 1;
                }
                self.redirect_next = true;
            }
            // A subshell's parentheses end a command, not its pipeline:
            // `(curl URL) | sh` still pipes a download into a shell.
            '(' | ')' => {
                self.end_word();
                self.end_command();
            }
            ';' | '&' | '|' | '\n' => self.operator(c),
            c if c.is_whitespace() => self.end_word(),
            other => {
                self.word.push(other);
                self.in_word = true;
            }
        }
    }

    fn single_quoted(&mut self) {
        self.in_word = true;
        self.i += 1;
        while self.i < self.chars.len() && self.chars[self.i] != '\'' {
            self.word.push(self.chars[self.i]);
            self.i += 1;
        }
    }

    /// `$'…'`: single-quoted with backslash escapes (`\xHH`, `\'`, `\\`).
    fn ansi_c_quoted(&mut self) {
        self.in_word = true;
        self.i += 1;
        while self.i < self.chars.len() && self.chars[self.i] != '\'' {
            let c = self.chars[self.i];
            if c == '\\' && self.i + 1 < self.chars.len() {
                self.i += 1;
                let e = self.chars[self.i];
                let hex: String = self.chars.iter().skip(self.i + 1).take(2).collect();
                match e {
                    'x' if hex.len() == 2 && u8::from_str_radix(&hex, 16).is_ok() => {
                        self.word.push(char::from(u8::from_str_radix(&hex, 16).unwrap_or(b'?')));
                        self.i += 2;
                    }
                    'n' => self.word.push('\n'),
                    't' => self.word.push('\t'),
                    other => self.word.push(other),
                }
            } else {
                self.word.push(c);
            }
            self.i += 1;
        }
    }

    fn double_quoted(&mut self) {
        self.in_word = true;
        self.i += 1;
        while self.i < self.chars.len() && self.chars[self.i] != '"' {
            match self.chars[self.i] {
                '\\' if self.peek().is_some_and(|n| "\"\\$`\n".contains(n)) => {
                    if let Some(n) = self.peek().filter(|n| *n != '\n') {
                        self.word.push(n);
                    }
                    self.i += 1;
                }
                '$' if self.peek() == Some('(') => {
                    let (inner, next) = balanced(&self.chars, self.i + 2);
                    self.push_sub(inner);
                    self.i = next;
                    continue;
                }
                '`' => {
                    let (inner, next) = backticked(&self.chars, self.i + 1);
                    self.push_sub(inner);
                    self.i = next;
                    continue;
                }
                other => self.word.push(other),
            }
            self.i += 1;
        }
    }

    /// A substitution whose text ends before `next`.
    fn substitution(&mut self, inner: String, next: usize) {
        self.push_sub(inner);
        self.in_word = true;
        self.i = next.saturating_sub(1);
    }

    fn push_sub(&mut self, inner: String) {
        self.word.push_str(&format!("\u{0}{}\u{0}", self.out.substitutions.len()));
        self.out.substitutions.push(inner);
    }

    fn redirection(&mut self, output: bool) {
        // A pending all-digit word is the redirected descriptor (`2>`).
        if self.in_word && !self.word.is_empty() && self.word.chars().all(|d| d.is_ascii_digit()) {
            self.word.clear();
            self.in_word = false;
        }
        self.end_word();
        while self.peek().is_some_and(|n| matches!(n, '>' | '<' | '|' | '&')) {
            self.i += 1;
        }
        self.redirect_next = output;
    }

    fn operator(&mut self, c: char) {
        self.end_word();
        let piped = c == '|' && self.peek() != Some('|');
        self.end_command();
        if !piped {
            self.end_pipeline();
        }
        // `&&`, `||`, `|&`, `;;`: one operator.
        if self.peek().is_some_and(|n| matches!(n, '&' | '|' | ';')) {
            self.i += 1;
        }
    }

    fn end_word(&mut self) {
        if self.in_word {
            let word = std::mem::take(&mut self.word);
            if self.redirect_next {
                self.cmd.redirects.push(word);
                self.redirect_next = false;
            } else {
                self.cmd.words.push(word);
            }
            self.in_word = false;
        }
    }

    fn end_command(&mut self) {
        if !self.cmd.words.is_empty() || !self.cmd.redirects.is_empty() {
            self.pipeline.push(std::mem::take(&mut self.cmd));
        }
    }

    fn end_pipeline(&mut self) {
        if !self.pipeline.is_empty() {
            self.out.pipelines.push(std::mem::take(&mut self.pipeline));
        }
    }
}

/// The text up to the `)` that closes a `(` before `start`, and the index
/// after it (quotes inside are skipped over; an unclosed one runs to the end).
fn balanced(chars: &[char], start: usize) -> (String, usize) {
    let mut depth = 1;
    let mut i = start;
    let mut quote: Option<char> = None;
    while i < chars.len() {
        let c = chars[i];
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) if c == '\\' => i += 1,
            Some(_) => {}
            None => match c {
                '\'' | '"' => quote = Some(c),
                '\\' => i += 1,
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        return (chars[start..i].iter().collect(), i + 1);
                    }
                }
                _ => {}
            },
        }
        i += 1;
    }
    (chars[start.min(chars.len())..].iter().collect(), chars.len())
}

/// The text up to the next unescaped backtick, and the index after it.
fn backticked(chars: &[char], start: usize) -> (String, usize) {
    let mut i = start;
    let mut inner = String::new();
    while i < chars.len() && chars[i] != '`' {
        if chars[i] == '\\' && i + 1 < chars.len() {
            i += 1;
        }
        inner.push(chars[i]);
        i += 1;
    }
    (inner, i + 1)
}
