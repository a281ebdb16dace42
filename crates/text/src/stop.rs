//! Stop strings over streamed text.

/// Watches streamed text for any of a set of stop strings. Text that could be the start of a
/// stop string is held back until it is known not to be one, so a client never sees part of a
/// stop string.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
    matched: Option<String>,
}

impl StopStrings {
    /// Watches for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> StopStrings {
        StopStrings { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), pending: String::new(), matched: None }
    }

    /// Feeds text; returns `(text safe to emit, stopped)`. After a stop, the text before the stop
    /// string is returned and everything after it is dropped.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_string(), false);
        }
        self.pending.push_str(text);
        if let Some((pos, i)) = self.stops.iter().enumerate().filter_map(|(i, s)| self.pending.find(s.as_str()).map(|p| (p, i))).min() {
            let out = self.pending[..pos].to_string();
            self.pending.clear();
            self.matched = Some(self.stops[i].clone());
            return (out, true);
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let keep = crate::sections::partial_suffix_len(&self.pending, self.stops.iter().map(String::as_str));
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// The stop string that ended the stream, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Text held back at the end of a stream that did not stop.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_matches_and_stops() {
        let mut s = StopStrings::new(&["</end>".to_string(), "STOP".to_string()]);
        assert_eq!(s.push("hello </"), ("hello ".to_string(), false));
        assert_eq!(s.push("e"), (String::new(), false));
        assert_eq!(s.push("x> more S"), ("</ex> more ".to_string(), false));
        assert_eq!(s.push("TOP tail"), (String::new(), true));
        assert_eq!(s.matched(), Some("STOP"));
        let mut s = StopStrings::new(&["ab".to_string()]);
        assert_eq!(s.push("xa"), ("x".to_string(), false));
        assert_eq!(s.flush(), "a");
    }
}
