//! Log text that message content cannot forge: values escaped for a
//! terminal, and the text format's fields built from them (the binaries'
//! logging and the front door's default logging share them).

/// `s` safe to print to a terminal: control characters (newlines, escape
/// sequences) and bidirectional overrides are escaped (`\n`, `\u{1b}`); all
/// else is as it is.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        let bidi = matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        if c.is_control() || bidi {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// The text format's fields, each value escaped with [`escape`]: a
/// field carrying message content (a reason, a key read from a body) cannot
/// start a forged log line or send escape sequences to a terminal.
pub fn escaped_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt;
    tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
        let text = escape(&format!("{value:?}"));
        if field.name() == "message" {
            write!(w, "{text}")
        } else {
            write!(w, "{field}={text}")
        }
    })
    .delimited(" ")
}
