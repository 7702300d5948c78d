//! `bench`: see [`brokerfence_bench::bench`].

fn main() {
    brokerfence_bench::bench::main()
}
