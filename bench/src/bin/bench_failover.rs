//! `bench_failover`: see [`brokerfence_bench::failover`].

fn main() {
    brokerfence_bench::failover::main()
}
