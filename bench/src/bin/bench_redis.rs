//! `bench_redis`: see [`brokerfence_bench::bench_redis`].

fn main() {
    brokerfence_bench::bench_redis::main()
}
