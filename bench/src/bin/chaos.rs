//! `chaos`: see [`brokerfence_bench::chaos`].

fn main() {
    brokerfence_bench::chaos::main()
}
