//! Routing traces: which experts each layer's router chose, step by step.
//!
//! # Format (JSON Lines, UTF-8)
//!
//! Line 1 is the header, every further non-empty line one decode step (one
//! token), with one entry per layer in layer order:
//!
//! ```text
//! {"format":"flashtier-trace","version":1,"layers":2,"experts":8}
//! {"ids":[[3,1],[0,7]],"scores":[[0.6,0.4],[0.9,0.1]]}
//! {"ids":[[3,5],[2,7]]}
//! ```
//!
//! - `layers` (>= 1) and `experts` (>= 1) bound every id: `0 <= id < experts`.
//! - `ids[l]` lists the distinct experts layer `l` used at that step (may be
//!   empty: the layer is dense or skipped).
//! - `scores` is optional; when present it has the same shape as `ids` and
//!   holds the router weights (finite numbers).
//! - Unknown fields are rejected, so a typo is an error rather than ignored.
//!
//! Parsing checks every rule above and returns a [`TraceError`] naming the line
//! and the field; it never panics on any input (a proptest and a fuzz-style
//! test feed it arbitrary bytes). Bound: a trace is held in memory; a line
//! longer than [`MAX_LINE_BYTES`] is rejected.

use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

/// Longest accepted line in bytes (a step of 256 layers x 64 ids fits easily).
pub const MAX_LINE_BYTES: usize = 4 << 20;

/// A parse or I/O failure, naming the line (1-based).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// Reading the trace failed.
    #[error("reading trace: {0}")]
    Io(#[from] std::io::Error),
    /// The first line is missing.
    #[error("trace is empty (expected a header line)")]
    Empty,
    /// A line is not valid JSON of the expected shape.
    #[error("line {line}: {what}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// The JSON parser's message.
        what: String,
    },
    /// The header names another format or version, or zero dimensions.
    #[error("line 1: bad header: {what}")]
    Header {
        /// What is wrong.
        what: String,
    },
    /// A step lists another number of layers than the header.
    #[error("line {line}: {got} layers, header says {expected}")]
    LayerCount {
        /// 1-based line number.
        line: usize,
        /// Layers in the header.
        expected: u32,
        /// Layers on this line.
        got: usize,
    },
    /// An expert id is not below the header's `experts`.
    #[error("line {line}: layer {layer}: expert {id} out of range (experts = {experts})")]
    ExpertOutOfRange {
        /// 1-based line number.
        line: usize,
        /// Layer.
        layer: usize,
        /// The id.
        id: u32,
        /// Experts per layer.
        experts: u32,
    },
    /// An expert id appears twice in one layer of one step.
    #[error("line {line}: layer {layer}: expert {id} listed twice")]
    DuplicateExpert {
        /// 1-based line number.
        line: usize,
        /// Layer.
        layer: usize,
        /// The id.
        id: u32,
    },
    /// `scores` does not match `ids` in shape, or holds a non-finite number.
    #[error("line {line}: layer {layer}: scores do not match ids ({what})")]
    Scores {
        /// 1-based line number.
        line: usize,
        /// Layer.
        layer: usize,
        /// What is wrong.
        what: String,
    },
    /// A line exceeds [`MAX_LINE_BYTES`].
    #[error("line {line}: longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong {
        /// 1-based line number.
        line: usize,
    },
}

/// One layer's routing at one step.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LayerRoute {
    /// Distinct expert ids, in router order.
    pub ids: Vec<u32>,
    /// Router weights, same length as `ids`, when known.
    pub scores: Option<Vec<f32>>,
}

/// One decode step (token): one route per layer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TraceStep {
    /// Routes, indexed by layer.
    pub layers: Vec<LayerRoute>,
}

/// A whole routing trace.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingTrace {
    /// Layers per step.
    pub layers: u32,
    /// Experts per layer.
    pub experts: u32,
    /// The steps, in decode order.
    pub steps: Vec<TraceStep>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    format: String,
    version: u32,
    layers: u32,
    experts: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepLine {
    ids: Vec<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    scores: Option<Vec<Vec<f32>>>,
}

const FORMAT_NAME: &str = "flashtier-trace";
const VERSION: u32 = 1;

impl RoutingTrace {
    /// Total (layer, expert) uses over the trace.
    #[must_use]
    pub fn accesses(&self) -> usize {
        self.steps
            .iter()
            .flat_map(|s| s.layers.iter())
            .map(|l| l.ids.len())
            .sum()
    }

    /// Parse a trace from JSON Lines.
    pub fn parse(reader: impl BufRead) -> Result<Self, TraceError> {
        let mut lines = reader.lines().enumerate();
        let header = loop {
            let Some((i, line)) = lines.next() else {
                return Err(TraceError::Empty);
            };
            let line = line?;
            if !line.trim().is_empty() {
                break parse_header(i + 1, &line)?;
            }
        };
        let mut trace = Self {
            layers: header.layers,
            experts: header.experts,
            steps: Vec::new(),
        };
        for (i, line) in lines {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            trace.steps.push(trace.parse_step(i + 1, &line)?);
        }
        Ok(trace)
    }

    /// Parse a trace held in a string.
    pub fn parse_str(text: &str) -> Result<Self, TraceError> {
        Self::parse(text.as_bytes())
    }

    fn parse_step(&self, line: usize, text: &str) -> Result<TraceStep, TraceError> {
        let raw: StepLine = parse_line(line, text)?;
        if raw.ids.len() != self.layers as usize {
            return Err(TraceError::LayerCount {
                line,
                expected: self.layers,
                got: raw.ids.len(),
            });
        }
        if let Some(s) = &raw.scores
            && s.len() != raw.ids.len()
        {
            return Err(TraceError::Scores {
                line,
                layer: s.len().min(raw.ids.len()),
                what: format!("{} score rows for {} layers", s.len(), raw.ids.len()),
            });
        }
        let mut scores = raw.scores.map(Vec::into_iter);
        let mut step = TraceStep::default();
        for (layer, ids) in raw.ids.into_iter().enumerate() {
            self.check_ids(line, layer, &ids)?;
            let layer_scores = scores.as_mut().and_then(Iterator::next);
            if let Some(s) = &layer_scores {
                check_scores(line, layer, ids.len(), s)?;
            }
            step.layers.push(LayerRoute {
                ids,
                scores: layer_scores,
            });
        }
        Ok(step)
    }

    fn check_ids(&self, line: usize, layer: usize, ids: &[u32]) -> Result<(), TraceError> {
        for (i, &id) in ids.iter().enumerate() {
            if id >= self.experts {
                return Err(TraceError::ExpertOutOfRange {
                    line,
                    layer,
                    id,
                    experts: self.experts,
                });
            }
            if ids.get(..i).is_some_and(|before| before.contains(&id)) {
                return Err(TraceError::DuplicateExpert { line, layer, id });
            }
        }
        Ok(())
    }

    /// Write the trace as JSON Lines (the format [`RoutingTrace::parse`] reads).
    pub fn write(&self, mut w: impl Write) -> Result<(), TraceError> {
        let header = Header {
            format: FORMAT_NAME.into(),
            version: VERSION,
            layers: self.layers,
            experts: self.experts,
        };
        serde_json::to_writer(&mut w, &header).map_err(std::io::Error::other)?;
        writeln!(w)?;
        for step in &self.steps {
            let has_scores =
                step.layers.iter().all(|l| l.scores.is_some()) && !step.layers.is_empty();
            let line = StepLine {
                ids: step.layers.iter().map(|l| l.ids.clone()).collect(),
                scores: has_scores.then(|| {
                    step.layers
                        .iter()
                        .map(|l| l.scores.clone().unwrap_or_default())
                        .collect()
                }),
            };
            serde_json::to_writer(&mut w, &line).map_err(std::io::Error::other)?;
            writeln!(w)?;
        }
        Ok(())
    }
}

/// JSON line `line` of a trace, at most [`MAX_LINE_BYTES`].
fn parse_line<T: serde::de::DeserializeOwned>(line: usize, text: &str) -> Result<T, TraceError> {
    if text.len() > MAX_LINE_BYTES {
        return Err(TraceError::LineTooLong { line });
    }
    serde_json::from_str(text).map_err(|e| TraceError::Syntax {
        line,
        what: e.to_string(),
    })
}

fn parse_header(line: usize, text: &str) -> Result<Header, TraceError> {
    let h: Header = parse_line(line, text)?;
    let bad = |what: String| Err(TraceError::Header { what });
    if h.format != FORMAT_NAME {
        return bad(format!("format {}, expected {FORMAT_NAME}", h.format));
    }
    if h.version != VERSION {
        return bad(format!("version {}, this build reads {VERSION}", h.version));
    }
    if h.layers == 0 || h.experts == 0 {
        return bad(format!(
            "zero dimension (layers {}, experts {})",
            h.layers, h.experts
        ));
    }
    Ok(h)
}

fn check_scores(line: usize, layer: usize, ids: usize, s: &[f32]) -> Result<(), TraceError> {
    let what = if s.len() != ids {
        format!("{} scores for {ids} ids", s.len())
    } else if let Some(bad) = s.iter().find(|v| !v.is_finite()) {
        format!("non-finite score {bad}")
    } else {
        return Ok(());
    };
    Err(TraceError::Scores { line, layer, what })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OK: &str = "{\"format\":\"flashtier-trace\",\"version\":1,\"layers\":2,\"experts\":8}\n\
        {\"ids\":[[3,1],[0,7]],\"scores\":[[0.6,0.4],[0.9,0.1]]}\n\n{\"ids\":[[3,5],[]]}\n";

    #[test]
    fn parses_the_documented_example() {
        let t = RoutingTrace::parse_str(OK).expect("valid trace");
        assert_eq!((t.layers, t.experts, t.steps.len()), (2, 8, 2));
        assert_eq!(t.steps[0].layers[1].ids, vec![0, 7]);
        assert_eq!(t.steps[0].layers[0].scores, Some(vec![0.6, 0.4]));
        assert_eq!(t.steps[1].layers[1].scores, None);
        assert_eq!(t.accesses(), 6);
    }

    #[test]
    fn typed_errors_name_the_line() {
        let h = "{\"format\":\"flashtier-trace\",\"version\":1,\"layers\":2,\"experts\":8}\n";
        type Check = fn(&TraceError) -> bool;
        let cases: [(&str, Check); 7] = [
            ("", |e| matches!(e, TraceError::Empty)),
            (
                "{\"format\":\"x\",\"version\":1,\"layers\":2,\"experts\":8}",
                |e| matches!(e, TraceError::Header { .. }),
            ),
            ("{\"ids\":[[1]]}", |e| {
                matches!(e, TraceError::LayerCount { line: 2, .. })
            }),
            ("{\"ids\":[[8],[]]}", |e| {
                matches!(e, TraceError::ExpertOutOfRange { line: 2, id: 8, .. })
            }),
            ("{\"ids\":[[1,1],[]]}", |e| {
                matches!(e, TraceError::DuplicateExpert { .. })
            }),
            ("{\"ids\":[[1],[2]],\"scores\":[[1.0],[]]}", |e| {
                matches!(e, TraceError::Scores { layer: 1, .. })
            }),
            ("{\"ids\":[[1],[2]],\"extra\":1}", |e| {
                matches!(e, TraceError::Syntax { line: 2, .. })
            }),
        ];
        for (i, (body, check)) in cases.into_iter().enumerate() {
            let text = if i < 2 {
                body.to_string()
            } else {
                format!("{h}{body}\n")
            };
            let err = RoutingTrace::parse_str(&text).expect_err(body);
            assert!(check(&err), "{body}: got {err}");
        }
    }

    fn arb_trace() -> impl Strategy<Value = RoutingTrace> {
        (1u32..4, 1u32..10).prop_flat_map(|(layers, experts)| {
            let route = (
                proptest::sample::subsequence(
                    (0..experts).collect::<Vec<_>>(),
                    0..=experts as usize,
                ),
                any::<bool>(),
            )
                .prop_map(|(ids, scored)| LayerRoute {
                    scores: scored.then(|| ids.iter().map(|&i| i as f32 * 0.25).collect()),
                    ids,
                });
            let step = proptest::collection::vec(route, layers as usize).prop_map(|layers| {
                // Scores are written per step: all layers or none.
                let all = layers.iter().all(|l| l.scores.is_some());
                TraceStep {
                    layers: layers
                        .into_iter()
                        .map(|mut l| {
                            if !all {
                                l.scores = None;
                            }
                            l
                        })
                        .collect(),
                }
            });
            proptest::collection::vec(step, 0..6).prop_map(move |steps| RoutingTrace {
                layers,
                experts,
                steps,
            })
        })
    }

    proptest! {
        #[test]
        fn write_then_parse_round_trips(t in arb_trace()) {
            let mut out = Vec::new();
            t.write(&mut out).expect("write to memory");
            let back = RoutingTrace::parse(out.as_slice()).expect("own output parses");
            prop_assert_eq!(back, t);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = RoutingTrace::parse(bytes.as_slice());
        }

        #[test]
        fn mutated_valid_trace_never_panics(pos in 0usize..200, byte in any::<u8>()) {
            let mut b = OK.as_bytes().to_vec();
            let p = pos % b.len();
            b[p] = byte;
            if let Ok(t) = RoutingTrace::parse(b.as_slice()) {
                for s in &t.steps {
                    prop_assert_eq!(s.layers.len(), t.layers as usize);
                    for l in &s.layers {
                        prop_assert!(l.ids.iter().all(|&i| i < t.experts));
                    }
                }
            }
        }
    }
}
