//! Tagged sections of streamed text, such as `<think>…</think>` reasoning or
//! `<tool_call>…</tool_call>` (see [`crate::ReplyParser`]).

/// Bytes at the end of `text` that could begin one of `markers` (the longest proper prefix of
/// a marker that `text` ends with): streamed text holds them back until the next piece tells.
pub(crate) fn partial_suffix_len<'a>(text: &str, markers: impl IntoIterator<Item = &'a str>) -> usize {
    markers
        .into_iter()
        .flat_map(|m| m.char_indices().skip(1).map(move |(i, _)| &m[..i]))
        .filter(|p| text.ends_with(p))
        .map(str::len)
        .max()
        .unwrap_or(0)
}

/// Which side of a tag pair a piece of text is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Section {
    /// Outside the tags (ordinary content).
    Outside,
    /// Between the open and the close tag (the tags themselves are dropped).
    Inside,
    /// A section just closed (empty text): separates consecutive sections.
    Closed,
}

/// Splits streamed text into [`Section`]s at an open and a close tag. A tag may arrive split
/// over several pieces: text that could be the start of the next tag is held back until it is
/// known not to be one, as [`StopStrings`](crate::StopStrings) does for stop strings.
#[derive(Clone, Debug)]
pub struct SectionSplitter {
    open: String,
    close: String,
    inside: bool,
    pending: String,
}

impl SectionSplitter {
    /// Splits at `open` … `close`, starting inside when `start_inside` (a prompt that ends with
    /// the open tag, as thinking templates render it).
    pub fn new(open: &str, close: &str, start_inside: bool) -> SectionSplitter {
        SectionSplitter { open: open.into(), close: close.into(), inside: start_inside, pending: String::new() }
    }

    /// Whether the text seen so far ends inside a section.
    pub fn inside(&self) -> bool {
        self.inside
    }

    /// Feeds a piece of text; returns the pieces that are now certain, in order.
    pub fn push(&mut self, text: &str) -> Vec<(Section, String)> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            let tag = if self.inside { &self.close } else { &self.open };
            if let Some(at) = self.pending.find(tag.as_str()) {
                let before: String = self.pending[..at].to_string();
                let skip = at + tag.len();
                self.pending.drain(..skip);
                if !before.is_empty() {
                    out.push((self.section(), before));
                }
                if self.inside {
                    out.push((Section::Closed, String::new()));
                }
                self.inside = !self.inside;
                continue;
            }
            // Keep the longest suffix that could begin the tag.
            let keep = partial_suffix_len(&self.pending, [tag.as_str()]);
            let cut = self.pending.len() - keep;
            if cut > 0 {
                let s: String = self.pending.drain(..cut).collect();
                out.push((self.section(), s));
            }
            return out;
        }
    }

    /// Whatever was held back, at the end of the stream.
    pub fn flush(&mut self) -> Vec<(Section, String)> {
        let s = std::mem::take(&mut self.pending);
        if s.is_empty() {
            vec![]
        } else {
            vec![(self.section(), s)]
        }
    }

    fn section(&self) -> Section {
        if self.inside {
            Section::Inside
        } else {
            Section::Outside
        }
    }

    /// Splits a whole text at once: `(inside, outside)` concatenated.
    pub fn split_all(mut self, text: &str) -> (String, String) {
        let (mut inside, mut outside) = (String::new(), String::new());
        for (sec, s) in self.push(text).into_iter().chain(self.flush()) {
            match sec {
                Section::Inside => inside.push_str(&s),
                Section::Outside => outside.push_str(&s),
                Section::Closed => {}
            }
        }
        (inside, outside)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(parts: &[&str], start_inside: bool) -> Vec<(Section, String)> {
        let mut s = SectionSplitter::new("<think>", "</think>", start_inside);
        let mut out: Vec<(Section, String)> = Vec::new();
        let mut pieces: Vec<(Section, String)> = parts.iter().flat_map(|p| s.push(p)).collect();
        pieces.extend(s.flush());
        for (sec, t) in pieces.into_iter().filter(|(s, _)| *s != Section::Closed) {
            match out.last_mut() {
                Some((last, acc)) if *last == sec => acc.push_str(&t),
                _ => out.push((sec, t)),
            }
        }
        out
    }

    #[test]
    fn splits_tags_across_pieces() {
        let got = join(&["<th", "ink>\nplan", " more</", "think>\n\nanswer <", "b>"], false);
        assert_eq!(got, vec![(Section::Inside, "\nplan more".to_string()), (Section::Outside, "\n\nanswer <b>".to_string())]);
        let got = join(&["still thinking</think>done"], true);
        assert_eq!(got, vec![(Section::Inside, "still thinking".to_string()), (Section::Outside, "done".to_string())]);
        assert!(SectionSplitter::new("<think>", "</think>", true).inside());
        let (i, o) = SectionSplitter::new("<tool_call>", "</tool_call>", false).split_all("a<tool_call>{}</tool_call>b");
        assert_eq!((i.as_str(), o.as_str()), ("{}", "ab"));
    }
}
