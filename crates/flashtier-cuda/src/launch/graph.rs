//! Executable graphs of queued segments: built the second time a segment's
//! shape comes, replayed (with changed arguments rewritten) after that.

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};

use cudarc::driver::sys::{
    self, CUDA_KERNEL_NODE_PARAMS, CUgraph, CUgraphExec, CUgraphNode, CUstream,
};

use super::{GraphStats, Launch, MAX_GRAPHS, SEEN_SHAPES};
use crate::error::CudaError;

/// The key of a segment's shape: its index in the step and every launch's
/// kernel, grid, block, shared memory and argument layout.
fn shape_key(segment: u32, launches: &[Launch]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    segment.hash(&mut h);
    for l in launches {
        (l.func.0 as usize).hash(&mut h);
        l.grid.hash(&mut h);
        l.block.hash(&mut h);
        l.smem.hash(&mut h);
        l.args.len().hash(&mut h);
        l.pdl.hash(&mut h);
    }
    h.finish()
}

fn node_params(l: &Launch, params: &mut [*mut std::ffi::c_void]) -> CUDA_KERNEL_NODE_PARAMS {
    let [gx, gy, gz] = l.grid;
    let [bx, by, bz] = l.block;
    CUDA_KERNEL_NODE_PARAMS {
        func: l.func.0,
        gridDimX: gx,
        gridDimY: gy,
        gridDimZ: gz,
        blockDimX: bx,
        blockDimY: by,
        blockDimZ: bz,
        sharedMemBytes: l.smem,
        kernelParams: params.as_mut_ptr(),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    }
}

/// One executable graph and the launches its nodes hold now.
struct Exec {
    key: u64,
    graph: CUgraph,
    exec: CUgraphExec,
    nodes: Vec<CUgraphNode>,
    launches: Vec<Launch>,
    used: u64,
}

// SAFETY: graph handles are driver objects; this crate touches each one
// only under the queue's mutex, one thread at a time, as the driver
// requires of graph objects.
unsafe impl Send for Exec {}

impl Drop for Exec {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `Exec::build` and are
        // destroyed once, here; a launch already queued keeps its own
        // reference in the driver. Errors on teardown are ignored.
        unsafe {
            if !self.exec.is_null() {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}

/// Whether the driver has `cuGraphAddDependencies_v2` (CUDA 12.3 on): the
/// call that makes an edge programmatic.
fn edge_data_supported() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        // SAFETY: looks a symbol up in the driver library cudarc already
        // loaded (a driver is present: a graph is being built); the
        // pointer is not called here.
        unsafe {
            sys::culib()
                .get::<unsafe extern "C" fn()>(b"cuGraphAddDependencies_v2")
                .is_ok()
        }
    })
}

/// Make `to` depend on `from` programmatically: `to`'s blocks may start
/// once every block of `from` has called `griddepcontrol.launch_dependents`
/// (or ended), and `to`'s `griddepcontrol.wait` returns when `from` has
/// finished. False when the driver refused (the caller adds a plain edge).
fn programmatic_edge(graph: CUgraph, from: CUgraphNode, to: CUgraphNode) -> bool {
    let edge = sys::CUgraphEdgeData {
        from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
        to_port: 0,
        type_: sys::CUgraphDependencyType::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC as u8,
        reserved: [0; 5],
    };
    // SAFETY: both nodes are kernel nodes of the live graph `graph`; one
    // edge, described by `edge`, which the driver reads during the call.
    let r = unsafe {
        sys::cuGraphAddDependencies_v2(graph, &raw const from, &raw const to, &raw const edge, 1)
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        tracing::warn!(
            ?r,
            "programmatic graph edge refused; plain edges from now on"
        );
        return false;
    }
    true
}

impl Exec {
    /// A graph of `launches` as a chain, in order; the edge into a launch
    /// whose kernel waits itself is programmatic while `pdl` (cleared when
    /// the driver refuses one).
    fn build(key: u64, launches: Vec<Launch>, pdl: &mut bool) -> Result<Self, CudaError> {
        let mut g = Self {
            key,
            graph: std::ptr::null_mut(),
            exec: std::ptr::null_mut(),
            nodes: Vec::with_capacity(launches.len()),
            launches: Vec::new(),
            used: 0,
        };
        // SAFETY: creates an empty graph into a valid out-pointer.
        unsafe { sys::cuGraphCreate(&raw mut g.graph, 0) }
            .result()
            .map_err(CudaError::driver("create a graph"))?;
        for l in &launches {
            let mut params = l.args.pointers();
            let p = node_params(l, &mut params);
            let mut prev = g.nodes.last().copied();
            let early = prev.filter(|_| *pdl && l.pdl && edge_data_supported());
            if early.is_some() {
                // The edge is added below, programmatic.
                prev = None;
            }
            let deps = prev.as_ref().map_or(std::ptr::null(), std::ptr::from_ref);
            let mut node: CUgraphNode = std::ptr::null_mut();
            // SAFETY: `g.graph` is a live graph; `deps` points to zero or one
            // node of it; `p` names a loaded kernel and `params` the
            // launch's argument values, which the driver copies.
            unsafe {
                sys::cuGraphAddKernelNode_v2(
                    &raw mut node,
                    g.graph,
                    deps,
                    usize::from(prev.is_some()),
                    &raw const p,
                )
            }
            .result()
            .map_err(CudaError::driver(format!("add {} to a graph", l.name)))?;
            if let Some(from) = early {
                if !programmatic_edge(g.graph, from, node) {
                    *pdl = false;
                    // SAFETY: both nodes belong to `g.graph`; one plain edge
                    // (no edge data: the default kind); the symbol exists
                    // (`edge_data_supported`).
                    unsafe {
                        sys::cuGraphAddDependencies_v2(
                            g.graph,
                            &raw const from,
                            &raw const node,
                            std::ptr::null(),
                            1,
                        )
                    }
                    .result()
                    .map_err(CudaError::driver(format!("order {} in a graph", l.name)))?;
                }
            }
            g.nodes.push(node);
        }
        // SAFETY: instantiates the complete graph into a valid out-pointer.
        unsafe { sys::cuGraphInstantiateWithFlags(&raw mut g.exec, g.graph, 0) }
            .result()
            .map_err(CudaError::driver("instantiate a graph"))?;
        g.launches = launches;
        Ok(g)
    }

    fn matches(&self, key: u64, launches: &[Launch]) -> bool {
        self.key == key
            && self.launches.len() == launches.len()
            && self
                .launches
                .iter()
                .zip(launches)
                .all(|(a, b)| a.same_shape(b))
    }

    /// Rewrite the nodes whose arguments changed; returns how many.
    fn patch(&mut self, launches: Vec<Launch>) -> Result<u64, CudaError> {
        let mut patched = 0;
        for ((old, new), &node) in self.launches.iter().zip(&launches).zip(&self.nodes) {
            if old.args == new.args {
                continue;
            }
            let mut params = new.args.pointers();
            let p = node_params(new, &mut params);
            // SAFETY: `node` belongs to the graph `self.exec` was
            // instantiated from, and `p` keeps its kernel and grid (same
            // shape, checked by `matches`); the driver copies the values.
            unsafe { sys::cuGraphExecKernelNodeSetParams_v2(self.exec, node, &raw const p) }
                .result()
                .map_err(CudaError::driver(format!(
                    "rewrite {} in a graph",
                    new.name
                )))?;
            patched += 1;
        }
        self.launches = launches;
        Ok(patched)
    }

    fn launch(&self, stream: CUstream) -> Result<(), CudaError> {
        // SAFETY: a live executable graph on the compute stream; its nodes'
        // arguments are launches whose buffers the queue's caller keeps.
        unsafe { sys::cuGraphLaunch(self.exec, stream) }
            .result()
            .map_err(CudaError::driver("launch a graph"))
    }
}

/// The executable graphs and the shapes seen.
#[derive(Default)]
pub(super) struct Cache {
    execs: Vec<Exec>,
    seen: VecDeque<u64>,
    clock: u64,
}

impl Cache {
    /// Issue segment `segment` of a step: replay, build, or launch one by one.
    pub(super) fn run(
        &mut self,
        segment: u32,
        launches: Vec<Launch>,
        stream: CUstream,
        stats: &mut GraphStats,
        pdl: &mut bool,
    ) -> Result<(), CudaError> {
        let key = shape_key(segment, &launches);
        self.clock += 1;
        let n = launches.len() as u64;
        if let Some(i) = self.execs.iter().position(|e| e.matches(key, &launches)) {
            let e = &mut self.execs[i];
            e.used = self.clock;
            stats.patched_nodes += e.patch(launches)?;
            stats.graph_launches += 1;
            stats.graph_kernels += n;
            return e.launch(stream);
        }
        if !self.seen.contains(&key) {
            if self.seen.len() >= SEEN_SHAPES {
                self.seen.pop_front();
            }
            self.seen.push_back(key);
            stats.direct_kernels += n;
            return launches.iter().try_for_each(|l| l.issue(stream));
        }
        if self.execs.len() >= MAX_GRAPHS {
            if let Some(oldest) = (0..self.execs.len()).min_by_key(|&i| self.execs[i].used) {
                self.execs.swap_remove(oldest);
            }
        }
        let mut e = Exec::build(key, launches, pdl)?;
        e.used = self.clock;
        stats.builds += 1;
        stats.graph_launches += 1;
        stats.graph_kernels += n;
        e.launch(stream)?;
        self.execs.push(e);
        Ok(())
    }
}
