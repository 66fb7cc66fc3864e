//! Strongly connected components of a small directed graph (Tarjan's
//! algorithm, iterative so that a deep module chain cannot overflow the
//! stack).

/// The strongly connected components of the graph on `nodes` nodes with
/// `edges` (from, to); every node is in exactly one component. Edges naming
/// a node `>= nodes` are ignored.
pub fn strongly_connected(nodes: usize, edges: &[(usize, usize)]) -> Vec<Vec<usize>> {
    let mut out_edges = vec![Vec::new(); nodes];
    for &(from, to) in edges {
        if from < nodes && to < nodes {
            out_edges[from].push(to);
        }
    }
    let mut state = Tarjan {
        index: vec![None; nodes],
        low: vec![0; nodes],
        on_stack: vec![false; nodes],
        stack: Vec::new(),
        next: 0,
        found: Vec::new(),
    };
    for root in 0..nodes {
        if state.index[root].is_none() {
            state.visit(root, &out_edges);
        }
    }
    state.found
}

struct Tarjan {
    index: Vec<Option<usize>>,
    low: Vec<usize>,
    on_stack: Vec<bool>,
    stack: Vec<usize>,
    next: usize,
    found: Vec<Vec<usize>>,
}

impl Tarjan {
    fn enter(&mut self, node: usize) {
        self.index[node] = Some(self.next);
        self.low[node] = self.next;
        self.next += 1;
        self.stack.push(node);
        self.on_stack[node] = true;
    }

    fn visit(&mut self, root: usize, out_edges: &[Vec<usize>]) {
        // (node, position in its edge list): the explicit call stack.
        let mut calls = vec![(root, 0usize)];
        self.enter(root);
        while let Some(&mut (node, ref mut at)) = calls.last_mut() {
            if let Some(&next) = out_edges[node].get(*at) {
                *at += 1;
                match self.index[next] {
                    None => {
                        self.enter(next);
                        calls.push((next, 0));
                    }
                    Some(seen) if self.on_stack[next] => {
                        self.low[node] = self.low[node].min(seen);
                    }
                    Some(_) => {}
                }
                continue;
            }
            calls.pop();
            if let Some(&(parent, _)) = calls.last() {
                self.low[parent] = self.low[parent].min(self.low[node]);
            }
            if Some(self.low[node]) == self.index[node] {
                let mut component = Vec::new();
                while let Some(member) = self.stack.pop() {
                    self.on_stack[member] = false;
                    component.push(member);
                    if member == node {
                        break;
                    }
                }
                component.sort_unstable();
                self.found.push(component);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::strongly_connected;

    fn cycles(nodes: usize, edges: &[(usize, usize)]) -> Vec<Vec<usize>> {
        let mut found: Vec<_> = strongly_connected(nodes, edges)
            .into_iter()
            .filter(|c| c.len() > 1)
            .collect();
        found.sort();
        found
    }

    #[test]
    fn a_chain_has_no_cycle() {
        assert!(cycles(4, &[(0, 1), (1, 2), (2, 3)]).is_empty());
    }

    #[test]
    fn two_cycles_and_a_bridge_between_them() {
        let edges = [(0, 1), (1, 0), (1, 2), (2, 3), (3, 4), (4, 2), (5, 5)];
        assert_eq!(cycles(6, &edges), vec![vec![0, 1], vec![2, 3, 4]]);
    }

    #[test]
    fn every_node_lands_in_one_component() {
        let edges = [(0, 1), (1, 2), (2, 0), (3, 1), (4, 4)];
        let mut all: Vec<usize> = strongly_connected(6, &edges)
            .into_iter()
            .flatten()
            .collect();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn a_long_chain_does_not_recurse() {
        let n = 200_000;
        let mut edges: Vec<(usize, usize)> = (0..n - 1).map(|i| (i, i + 1)).collect();
        edges.push((n - 1, 0));
        let found = cycles(n, &edges);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].len(), n);
    }
}
