//! The template engine set up as transformers sets up Jinja2:
//! `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
//! extensions=[loopcontrols])` with its `tojson` filter and the globals
//! `raise_exception` and `strftime_now`.
//!
//! Differences from Jinja2 that templates can notice are listed in the
//! crate docs; the ones handled here: `{{ value }}` and `|string` print
//! Python's `str(value)`, `tojson` is `json.dumps` (not HTML-escaped), and
//! Python's string, list and dict methods come from minijinja-contrib's
//! pycompat callback.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, ValueKind, ValueOrKwargs, from_args};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};

use super::clock::{CivilTime, strftime};
use super::pyfmt::{JsonStyle, json_dumps, python_str};

/// The error source attached to `raise_exception`'s error, so a render
/// failure can be told apart from the template's own refusal.
#[derive(Debug)]
pub(crate) struct Raised(pub String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// `raise_exception(message)`: fails the render with the template's text.
fn raise_exception(message: Value) -> Result<Value, Error> {
    let mut text = String::new();
    python_str(&message, &mut text)?;
    Err(Error::new(ErrorKind::InvalidOperation, text.clone()).with_source(Raised(text)))
}

/// `strftime_now(format)`.
fn strftime_now(format: String) -> String {
    strftime(&format, &CivilTime::now())
}

/// Python truthiness of an optional argument.
fn truthy(value: Option<&Value>) -> bool {
    value.is_some_and(Value::is_true)
}

/// `json.dumps`' `indent`: `None`, a count of spaces, or the unit string.
fn indent_unit(value: Option<&Value>) -> Result<Option<String>, Error> {
    let Some(value) = value.filter(|v| !v.is_none() && !v.is_undefined()) else {
        return Ok(None);
    };
    match value.kind() {
        ValueKind::String => Ok(Some(value.as_str().unwrap_or_default().to_owned())),
        ValueKind::Bool => Ok(Some(if value.is_true() { " " } else { "" }.to_owned())),
        ValueKind::Number if value.is_integer() => {
            let spaces = i64::try_from(value.clone()).unwrap_or(0).clamp(0, 64);
            Ok(Some(" ".repeat(usize::try_from(spaces).unwrap_or(0))))
        }
        _ => Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: indent must be an integer or a string",
        )),
    }
}

/// `json.dumps`' `separators`: a pair of strings.
fn separators(value: Option<&Value>) -> Result<Option<(String, String)>, Error> {
    let Some(value) = value.filter(|v| !v.is_none() && !v.is_undefined()) else {
        return Ok(None);
    };
    let bad = || {
        Error::new(
            ErrorKind::InvalidOperation,
            "tojson: separators must be a pair of strings",
        )
    };
    let items: Vec<Value> = value.try_iter().map_err(|_| bad())?.collect();
    match items.as_slice() {
        [item, key] => match (item.as_str(), key.as_str()) {
            (Some(item), Some(key)) => Ok(Some((item.to_owned(), key.to_owned()))),
            _ => Err(bad()),
        },
        _ => Err(bad()),
    }
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, positional or by keyword.
fn tojson(value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let args = args.into_values();
    let (positional, kwargs) = from_args::<(&[Value], Kwargs)>(&args)?;
    if positional.len() > 4 {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments (ensure_ascii, indent, separators, sort_keys)",
        ));
    }
    let mut options: [Option<Value>; 4] = Default::default();
    for (slot, given) in options.iter_mut().zip(positional) {
        *slot = Some(given.clone());
    }
    for (slot, name) in
        options
            .iter_mut()
            .zip(["ensure_ascii", "indent", "separators", "sort_keys"])
    {
        let named: Option<Value> = kwargs.get(name)?;
        if named.is_some() {
            *slot = named;
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators_arg, sort_keys] = options;
    let style = JsonStyle::new(
        truthy(ensure_ascii.as_ref()),
        indent_unit(indent.as_ref())?,
        separators(separators_arg.as_ref())?,
        truthy(sort_keys.as_ref()),
    );
    let mut out = String::new();
    json_dumps(value, &style, &mut out)?;
    Ok(Value::from(out))
}

/// `|string`: Python's `str(value)`.
fn string_filter(value: &Value) -> Result<String, Error> {
    let mut out = String::new();
    python_str(value, &mut out)?;
    Ok(out)
}

/// A template engine holding nothing but transformers' settings.
pub(crate) fn environment() -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()?,
    );
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        let mut text = String::new();
        python_str(value, &mut text)?;
        out.write_str(&text)
            .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write the output"))
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", string_filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    Ok(env)
}
