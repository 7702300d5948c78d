//! `soak`: see [`brokerfence_bench::soak`].

fn main() {
    brokerfence_bench::soak::main()
}
