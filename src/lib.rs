pub use adapters;
pub use fence;
