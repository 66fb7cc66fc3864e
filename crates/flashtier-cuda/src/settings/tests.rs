//! The settings' parsing: defaults, values in range, a bad value naming
//! its variable, and the table against the defaults.

use super::*;

#[test]
fn unset_gives_the_defaults() {
    let env = Env::from_pairs(&[]);
    assert_eq!(LaunchSettings::read(&env), Ok(LaunchSettings::default()));
    assert_eq!(Tuning::read(&env), Ok(Tuning::default()));
    assert_eq!(dump_cubin(&env), None);
}

#[test]
fn values_in_range_are_taken() {
    let env = Env::from_pairs(&[
        (CUDA_GRAPHS, "0"),
        (PDL, "0"),
        (GRAPH_SEGMENT, "4096"),
        (STREAM_WEIGHTS, "0"),
        (GEMV_LOADS, "16"),
        (ATTN_AHEAD, "1"),
        (DOWN_ROWS, "2"),
        (PROMPT_TILES, "0"),
        (PROMPT_MMA, "0"),
        (PROMPT_ATTN, "0"),
        (PROMPT_ATTN_TC, "0"),
        (PROMPT_ATTN_PIPE, "1"),
        (PROMPT_BLAS, "0"),
        (GEMM_TILE, "8x4"),
        (GROUP_TILE, "4x8"),
        (MMA_BK, "32"),
        (DEVICE_GROUPS, "0"),
        (DUMP_CUBIN, "/tmp/sass"),
    ]);
    let l = LaunchSettings::read(&env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        l,
        LaunchSettings {
            graphs: false,
            pdl: false,
            segment_launches: 4096
        }
    );
    let t = Tuning::read(&env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        t,
        Tuning {
            stream_weights: false,
            gemv_loads: 16,
            attn_ahead: 1,
            down_rows: 2,
            prompt_tiles: false,
            prompt_mma: false,
            prompt_attn: false,
            prompt_attn_tc: false,
            prompt_attn_pipe: true,
            prompt_blas: false,
            tiles: (TileShape { tm: 8, tn: 4 }, TileShape { tm: 4, tn: 8 }),
            mma_bk: 32,
            device_groups: false,
        }
    );
    assert_eq!(dump_cubin(&env), Some(PathBuf::from("/tmp/sass")));
}

#[test]
fn a_bad_value_names_its_variable() {
    for (var, bad) in [
        (CUDA_GRAPHS, "off"),
        (PDL, "2"),
        (GRAPH_SEGMENT, "0"),
        (GRAPH_SEGMENT, "4097"),
        (GEMV_LOADS, "17"),
        (ATTN_AHEAD, "9"),
        (DOWN_ROWS, "0"),
        (PROMPT_TILES, "yes"),
        (PROMPT_MMA, "2"),
        (PROMPT_ATTN, "on"),
        (PROMPT_ATTN_TC, "off"),
        (PROMPT_ATTN_PIPE, "2"),
        (PROMPT_BLAS, "2"),
        (GEMM_TILE, "8x8"),
        (GROUP_TILE, "3x4"),
        (MMA_BK, "48"),
        (DEVICE_GROUPS, "yes"),
    ] {
        let pairs = [(var, bad)];
        let env = Env::from_pairs(&pairs);
        let e = LaunchSettings::read(&env)
            .err()
            .or_else(|| Tuning::read(&env).err())
            .unwrap_or_else(|| panic!("{var}={bad} was taken"));
        assert_eq!(e.var, var);
        assert!(e.to_string().contains(bad), "{e}");
    }
}

#[test]
fn the_table_matches_the_defaults() {
    let d = Tuning::default();
    let l = LaunchSettings::default();
    let default_of = |name: &str| {
        SETTINGS
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.default)
            .unwrap_or_else(|| panic!("{name} is not in the table"))
    };
    let flag = |b: bool| if b { "1" } else { "0" };
    assert_eq!(default_of(CUDA_GRAPHS), flag(l.graphs));
    assert_eq!(default_of(PDL), flag(l.pdl));
    assert_eq!(default_of(GRAPH_SEGMENT), l.segment_launches.to_string());
    assert_eq!(default_of(STREAM_WEIGHTS), flag(d.stream_weights));
    assert_eq!(default_of(GEMV_LOADS), d.gemv_loads.to_string());
    assert_eq!(default_of(ATTN_AHEAD), d.attn_ahead.to_string());
    assert_eq!(default_of(DOWN_ROWS), d.down_rows.to_string());
    assert_eq!(default_of(PROMPT_TILES), flag(d.prompt_tiles));
    assert_eq!(default_of(PROMPT_MMA), flag(d.prompt_mma));
    assert_eq!(default_of(PROMPT_ATTN), flag(d.prompt_attn));
    assert_eq!(default_of(PROMPT_ATTN_TC), flag(d.prompt_attn_tc));
    assert_eq!(default_of(PROMPT_ATTN_PIPE), flag(d.prompt_attn_pipe));
    assert_eq!(default_of(PROMPT_BLAS), flag(d.prompt_blas));
    let shape = |t: TileShape| format!("{}x{}", t.tm, t.tn);
    assert_eq!(default_of(GEMM_TILE), shape(d.tiles.0));
    assert_eq!(default_of(GROUP_TILE), shape(d.tiles.1));
    assert_eq!(default_of(MMA_BK), d.mma_bk.to_string());
    assert_eq!(default_of(DEVICE_GROUPS), flag(d.device_groups));
    assert!(SETTINGS.iter().all(|s| s.name.starts_with("FLASHTIER_")));
}
