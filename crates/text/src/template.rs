//! Hugging Face chat templates with minijinja.
//!
//! transformers renders templates with Jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls)
//! plus `raise_exception`, `strftime_now` and a `tojson` that is Python's `json.dumps`
//! (`", "` and `": "` separators, non-ASCII kept). Templates also call Python string methods
//! (`startswith`, `split`, `rstrip`, ...), which minijinja-contrib's pycompat provides.

use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;
use std::sync::Arc;

/// A template that failed to compile or render (including `raise_exception` from the template).
#[derive(Debug, thiserror::Error)]
#[error("chat template: {0}")]
pub struct TemplateError(pub String);

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
    bos_token: String,
    eos_token: String,
    calls: crate::CallSyntax,
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` are exposed to the template as in transformers.
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
        env.add_function("strftime_now", |fmt: String| strftime(&fmt, now_unix()));
        env.add_template_owned("chat", source.to_string()).map_err(|e| TemplateError(format!("{e:#}")))?;
        Ok(ChatTemplate {
            env: Arc::new(env),
            bos_token: bos_token.unwrap_or("").into(),
            eos_token: eos_token.unwrap_or("").into(),
            calls: crate::CallSyntax::of_template(source),
        })
    }

    /// How the model this template was written for writes tool calls.
    pub fn call_syntax(&self) -> crate::CallSyntax {
        self.calls
    }

    /// Renders `messages` (OpenAI-style objects). `tools` is passed when present; `extra` holds
    /// template kwargs such as `enable_thinking`.
    pub fn render(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Json>,
    ) -> Result<String, TemplateError> {
        let mut ctx = serde_json::Map::new();
        for (k, v) in extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Json::Array(messages.to_vec()));
        if let Some(t) = tools {
            ctx.insert("tools".into(), Json::Array(t.to_vec()));
        }
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        ctx.insert("bos_token".into(), Json::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(self.eos_token.clone()));
        let t = self.env.get_template("chat").map_err(|e| TemplateError(e.to_string()))?;
        t.render(Value::from_serialize(&ctx)).map_err(|e| {
            // `raise_exception` messages are the template author's words: pass them through.
            match e.kind() {
                ErrorKind::InvalidOperation => TemplateError(e.detail().unwrap_or("raise_exception").to_string()),
                _ => TemplateError(format!("{e:#}")),
            }
        })
    }
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn python_json(v: &Json, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).unwrap());
                out.push_str(": ");
                python_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).unwrap()),
    }
}

fn now_unix() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// A small `strftime` (UTC) covering what chat templates use for "today's date".
fn strftime(fmt: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] =
        ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    const DAYS: [&str; 7] = ["Thursday", "Friday", "Saturday", "Sunday", "Monday", "Tuesday", "Wednesday"];
    let days = unix.div_euclid(86400);
    let secs = unix.rem_euclid(86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    let (month, weekday) = (MONTHS[(m - 1) as usize], DAYS[days.rem_euclid(7) as usize]);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs % 3600 / 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{:03}", doy_of_year(y, m, d))),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

fn doy_of_year(y: i64, m: i64, d: i64) -> i64 {
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    CUM[(m - 1) as usize] + d + if leap && m > 2 { 1 } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_prints_like_python() {
        let v: Json = serde_json::from_str(r#"{"b": [1, 2.5, "é<&>"], "a": {"x": null, "y": true}, "e": []}"#).unwrap();
        let mut s = String::new();
        python_json(&v, None, 0, &mut s);
        assert_eq!(s, r#"{"b": [1, 2.5, "é<&>"], "a": {"x": null, "y": true}, "e": []}"#);
        let mut s = String::new();
        python_json(&serde_json::json!({"k": [1]}), Some(2), 0, &mut s);
        assert_eq!(s, "{\n  \"k\": [\n    1\n  ]\n}");
    }

    #[test]
    fn strftime_known_dates() {
        assert_eq!(strftime("%d %B %Y", 0), "01 January 1970");
        // 2026-11-30 12:34:56 UTC, a Monday.
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S %A %b %j", 1_796_042_096), "2026-11-30 12:34:56 Monday Nov 334");
    }

    #[test]
    fn raise_exception_reaches_the_caller() {
        let t = ChatTemplate::new("{{ raise_exception('only user and assistant roles') }}", None, None).unwrap();
        let e = t.render(&[], None, true, &Default::default()).unwrap_err();
        assert!(e.to_string().contains("only user and assistant roles"), "{e}");
    }

    #[test]
    fn loop_controls_namespace_and_string_methods() {
        let src = "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{{ m.content.strip().split(',')[0] | upper }}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}={{ ns.n }}";
        let t = ChatTemplate::new(src, None, None).unwrap();
        let msgs: Vec<Json> = serde_json::from_str(r#"[{"role":"a","content":" x,y "},{"role":"skip","content":"z"},{"role":"b","content":"q"},{"role":"c","content":"r"},{"role":"d","content":"s"}]"#).unwrap();
        assert_eq!(t.render(&msgs, None, false, &Default::default()).unwrap(), "XQ=2");
    }
}
